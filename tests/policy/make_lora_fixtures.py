"""Makes LoRA adapters with PEFT itself, and PEFT's logits with them, for test_lora.cpp.

python make_lora_fixtures.py OUT_DIR writes OUT_DIR/<name>/ (PeftModel.save_pretrained output
plus peft_logits.safetensors) for each tiny model in the sibling hf_models fixture, and
OUT_DIR/versions.json. The adapters cover PEFT's variety: all seven projections, attention only
(on Qwen2's biased q/k/v), rsLoRA with dotted-suffix targets, a large alpha. A and B are drawn
at random (B non-zero), so a missed or misplaced adapter changes the logits.
"""
import json
import os
import sys

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

ADAPTERS = {
    "llama3": dict(r=4, lora_alpha=8, lora_dropout=0.0,
                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qwen2": dict(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "qwen3": dict(r=2, lora_alpha=4, lora_dropout=0.0, use_rslora=True,
                  target_modules=["self_attn.v_proj", "gate_proj", "down_proj"]),
    "llama_tied": dict(r=4, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "up_proj"]),
}


def main(out):
    models = os.path.join(os.path.dirname(os.path.abspath(out)), "hf_models")
    os.makedirs(out, exist_ok=True)
    for name, options in ADAPTERS.items():
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(4321)
        base_path = os.path.join(models, name)
        base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **options))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if ".lora_A." in pname or ".lora_B." in pname:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        path = os.path.join(out, name)
        model.save_pretrained(path)

        ref = load_file(os.path.join(base_path, "reference.safetensors"))
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"],
                           position_ids=ref["position_ids"]).logits
        save_file({"input_ids": ref["input_ids"], "attention_mask": ref["attention_mask"],
                   "position_ids": ref["position_ids"], "logits": logits.float().contiguous()},
                  os.path.join(path, "peft_logits.safetensors"))

    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump({"peft": peft.__version__, "transformers": transformers.__version__, "torch": torch.__version__}, f)


if __name__ == "__main__":
    main(sys.argv[1])
