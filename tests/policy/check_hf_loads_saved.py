"""transformers loads the folders troupe saved (test_checkpoint) and reproduces troupe's logits.

python check_hf_loads_saved.py SAVED_DIR: every subfolder with troupe_logits.safetensors is
loaded with AutoModelForCausalLM; its logits for the stored batch must match troupe's on real
tokens: 1e-4 for the tiny models, 1e-3 for the 30-layer SmolLM2.
"""
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(saved):
    failures = 0
    checked = 0
    for name in sorted(os.listdir(saved)):
        path = os.path.join(saved, name)
        ref_path = os.path.join(path, "troupe_logits.safetensors")
        if not os.path.exists(ref_path):
            continue
        ref = load_file(ref_path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"],
                           position_ids=ref["position_ids"]).logits
        real = ref["attention_mask"].bool()
        err = (logits[real] - ref["logits"][real]).abs().max().item()
        tol = 1e-3 if name == "smollm2" else 1e-4
        ok = err < tol
        print(f"{name}: transformers vs troupe max abs error {err:.3g} (tolerance {tol:g}) {'ok' if ok else 'FAIL'}")
        failures += not ok
        checked += 1
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            tok = AutoTokenizer.from_pretrained(path)
            text = "Hello world! 12345 <|im_start|>user\nHi<|im_end|>"
            ids = tok(text, add_special_tokens=False)["input_ids"]
            ok = tok.decode(ids) == text
            print(f"{name}: tokenizer loads, {len(ids)} ids, round trip {'ok' if ok else 'FAIL'}")
            failures += not ok
    if checked == 0:
        print("no saved folders with troupe_logits.safetensors found in", saved)
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
