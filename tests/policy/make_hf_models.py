"""Makes tiny random-weight Hugging Face models and their reference logits for the parity tests.

python make_hf_models.py OUT_DIR writes OUT_DIR/<name>/ (save_pretrained output plus
reference.safetensors) for a Llama-3 with llama3 rope scaling, a Qwen2 (q/k/v bias), a Qwen3
(q_norm/k_norm, explicit head_dim) and a tied-embedding Llama (SmolLM2's layout), and
OUT_DIR/versions.json with the library versions that produced them. Logits come from
transformers itself: the padded batch from one forward with an attention mask, the packed
row from separate forwards of each document (so packing is checked against no packing).
"""
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file

VOCAB = 160
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2)

MODELS = {
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        rope_theta=1000000.0, tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        head_dim=24, rope_theta=1000000.0, tie_word_embeddings=False)),
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_theta=100000.0, tie_word_embeddings=True)),
}


def padded_batch(gen):
    """Three rows of length 12: full, right-padded (7 tokens), left-padded (5 tokens)."""
    T = 12
    ids = torch.randint(3, VOCAB, (3, T), generator=gen)
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, :7] = 0
    ids[mask == 0] = 0
    # Positions count real tokens only, as generation does for left padding.
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def randomize(model, gen):
    # Norm weights away from 1 and non-zero biases, so a missed norm or bias shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def main(out):
    os.makedirs(out, exist_ok=True)
    for name, (config_cls, model_cls, extra) in MODELS.items():
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1234)
        config = config_cls(**COMMON, **extra)
        model = model_cls(config).eval()
        randomize(model, gen)
        path = os.path.join(out, name)
        model.save_pretrained(path)

        ids, mask, pos = padded_batch(gen)
        docs = [torch.randint(3, VOCAB, (1, n), generator=gen) for n in (5, 8, 3)]
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            doc_logits = [model(input_ids=d).logits for d in docs]
        packed_ids = torch.cat(docs, dim=1)
        packed_pos = torch.cat([torch.arange(d.shape[1]) for d in docs]).unsqueeze(0)
        save_file({
            "input_ids": ids, "attention_mask": mask, "position_ids": pos,
            "logits": logits.float().contiguous(),
            "packed_input_ids": packed_ids, "packed_position_ids": packed_pos,
            "packed_logits": torch.cat(doc_logits, dim=1).float().contiguous(),
        }, os.path.join(path, "reference.safetensors"))

    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__}, f)


if __name__ == "__main__":
    main(sys.argv[1])
