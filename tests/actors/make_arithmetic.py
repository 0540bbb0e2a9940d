"""Makes the tiny arithmetic task that configs/tiny_arithmetic_grpo.yaml trains on.

python make_arithmetic.py OUT_DIR HF_MODELS_DIR QWEN3_TOKENIZER_DIR writes
  OUT_DIR/train.jsonl   {"prompt": "3+4=", "answer": "7"} for a, b in 0..4
  OUT_DIR/format.jsonl  the format stage: one-digit completions, right 15% of the time
  OUT_DIR/prefs.jsonl   preference pairs for DPO: the right sum chosen over a wrong one
  OUT_DIR/model/        the random tiny Llama (HF_MODELS_DIR/llama3) with the Qwen3 tokenizer,
                        whose single characters "0".."9", "+", "=" all fall inside its
                        160-token vocabulary.
"""
import json
import os
import random
import shutil
import sys


def main(out, hf_models, qwen3):
    os.makedirs(out, exist_ok=True)
    problems = [(f"{a}+{b}=", a + b) for a in range(5) for b in range(5)]
    with open(os.path.join(out, "train.jsonl"), "w") as f:
        for prompt, total in problems:
            f.write(json.dumps({"prompt": prompt, "answer": str(total)}) + "\n")
    rng = random.Random(0)
    with open(os.path.join(out, "format.jsonl"), "w") as f:
        for _ in range(40):
            for prompt, total in problems:
                digit = total if rng.random() < 0.15 else rng.randrange(9)
                f.write(json.dumps({"prompt": prompt, "completion": str(digit)}) + "\n")
    with open(os.path.join(out, "prefs.jsonl"), "w") as f:
        for _ in range(4):
            for prompt, total in problems:
                wrong = rng.choice([d for d in range(9) if d != total])
                f.write(json.dumps({"prompt": prompt, "chosen": str(total), "rejected": str(wrong)}) + "\n")
    model = os.path.join(out, "model")
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(os.path.join(hf_models, "llama3"), model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(qwen3, name), os.path.join(model, name))


if __name__ == "__main__":
    main(*sys.argv[1:4])
