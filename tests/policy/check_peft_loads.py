"""PEFT loads the adapters troupe saved (test_lora) and reproduces troupe's logits.

python check_peft_loads.py SAVED_DIR: every subfolder holding adapter_config.json and
troupe_logits.safetensors is loaded with peft.PeftModel.from_pretrained onto the model named by
its base_model_name_or_path. Prints one line per adapter,
  NAME: peft_error E merged_error M adapter_effect A
with the max abs logit differences on real tokens between PEFT and troupe (E), PEFT's
merge_and_unload() model and troupe (M), and PEFT with and without the adapter (A, so that the
comparison is not vacuous). Exits 1 if an adapter tensor PEFT holds differs from the file's.
"""
import json
import os
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def logits_of(model, ref):
    with torch.no_grad():
        return model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"],
                     position_ids=ref["position_ids"]).logits


def main(saved):
    failures = 0
    checked = 0
    for name in sorted(os.listdir(saved)):
        path = os.path.join(saved, name)
        ref_path = os.path.join(path, "troupe_logits.safetensors")
        if not (os.path.exists(ref_path) and os.path.exists(os.path.join(path, "adapter_config.json"))):
            continue
        ref = load_file(ref_path)
        real = ref["attention_mask"].bool()
        with open(os.path.join(path, "adapter_config.json")) as f:
            base_path = json.load(f)["base_model_name_or_path"]
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
        base_logits = logits_of(base, ref)
        model = PeftModel.from_pretrained(base, path).eval()

        # Every tensor in the file must have landed in PEFT's adapter, not been skipped.
        held = model.state_dict()
        for key, value in load_file(os.path.join(path, "adapter_model.safetensors")).items():
            peft_key = key.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight")
            if peft_key not in held or not torch.equal(held[peft_key], value):
                print(f"{name}: {key} not loaded by PEFT as saved")
                failures += 1

        logits = logits_of(model, ref)
        err = (logits[real] - ref["logits"][real]).abs().max().item()
        effect = (logits[real] - base_logits[real]).abs().max().item()
        merged = model.merge_and_unload().eval()
        merged_err = (logits_of(merged, ref)[real] - ref["logits"][real]).abs().max().item()
        print(f"{name}: peft_error {err:.6g} merged_error {merged_err:.6g} adapter_effect {effect:.6g}")
        checked += 1
    if checked == 0:
        print("no adapter folders with troupe_logits.safetensors found in", saved)
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
