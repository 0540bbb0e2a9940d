"""Reference data for tests/trainer/test_sft.cpp and test_dpo.cpp, made by code independent of troupe.

python make_sft_fixtures.py OUT_DIR writes
  OUT_DIR/bytes/           a byte-level tokenizer (256 byte tokens, no merges, <|im_start|>, <|im_end|>,
                           <|endoftext|>) with a ChatML template: small enough for a tiny model's
                           vocabulary, so SFT can be tested from JSONL text to generated text
  OUT_DIR/chat_masks.json  conversations with the ids and assistant masks that transformers'
                           apply_chat_template(return_assistant_tokens_mask=True) gives for the Qwen3
                           tokenizer under a ChatML template whose assistant content and <|im_end|>
                           are in a {% generation %} block
  OUT_DIR/dpo_reference.json  summed log-probs of a fixed batch and the sigmoid DPO loss and metrics,
                           written the way TRL's DPOTrainer computes them (float64)
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

OUT = Path(sys.argv[1])
ROOT = Path(__file__).resolve().parents[2]
QWEN3 = ROOT.parent / "shared" / "data" / "tokenizers" / "qwen3" / "tokenizer.json"

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_GENERATION = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is 12 + 30?"},
     {"role": "assistant", "content": "42"}],
    [{"role": "user", "content": "Say hi in French."},
     {"role": "assistant", "content": " Bonjour !\n"},
     {"role": "user", "content": "And in Japanese?"},
     {"role": "assistant", "content": "こんにちは (konnichiwa)."}],
    [{"role": "user", "content": "Count: 1 2 3"},
     {"role": "assistant", "content": "4 5 6\n\n7"},
     {"role": "user", "content": "thanks"}],
]


def byte_tokenizer(out):
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}))


def chat_masks():
    tok = PreTrainedTokenizerFast(tokenizer_file=str(QWEN3))
    cases = []
    for messages in CONVERSATIONS:
        enc = tok.apply_chat_template(messages, chat_template=CHATML_GENERATION, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        cases.append({"messages": messages, "ids": list(enc["input_ids"]),
                      "assistant_mask": list(enc["assistant_masks"])})
    return cases


def dpo_reference():
    beta, ls = 0.25, 0.1
    policy_chosen = torch.tensor([-12.5, -30.25, -7.0, -55.5], dtype=torch.float64)
    policy_rejected = torch.tensor([-14.0, -28.0, -9.5, -50.0], dtype=torch.float64)
    ref_chosen = torch.tensor([-13.0, -29.0, -8.0, -54.0], dtype=torch.float64)
    ref_rejected = torch.tensor([-13.5, -29.5, -8.5, -51.0], dtype=torch.float64)
    # TRL DPOTrainer.dpo_loss, loss_type="sigmoid"
    chosen_logratios = policy_chosen - ref_chosen
    rejected_logratios = policy_rejected - ref_rejected
    logits = chosen_logratios - rejected_logratios
    losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
    chosen_rewards = beta * (policy_chosen - ref_chosen)
    rejected_rewards = beta * (policy_rejected - ref_rejected)
    return {
        "beta": beta, "label_smoothing": ls,
        "policy_chosen": policy_chosen.tolist(), "policy_rejected": policy_rejected.tolist(),
        "ref_chosen": ref_chosen.tolist(), "ref_rejected": ref_rejected.tolist(),
        "loss": losses.mean().item(),
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).double().mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
    }


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    byte_tokenizer(OUT / "bytes")
    (OUT / "chat_masks.json").write_text(json.dumps(chat_masks(), ensure_ascii=False))
    (OUT / "dpo_reference.json").write_text(json.dumps(dpo_reference()))


if __name__ == "__main__":
    main()
