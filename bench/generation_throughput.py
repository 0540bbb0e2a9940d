"""Generation throughput of SmolLM2-135M-Instruct (CPU or --device): troupe's engine against transformers.

python bench/generation_throughput.py [--prompts 16 --n 8 --max-tokens 128] [--device cuda] [--dtype bfloat16]
Both sides sample n completions of the same chat-formatted GSM8K prompts (the same token
ids), at temperature 1, to exactly max-tokens new tokens each (EOS ignored), in --dtype
(float32 unless told) on the same threads (or the same GPU); prints tokens/s for each and the ratio. Each side first
runs the same warm-up outside the timing, on every device: the first prompt, greedy, 4 tokens.

The prefill is not the same work on both sides. troupe's engine prefills each prompt once, alone
and unpadded, and its n samples all sample their first token from that one prefill's logits;
the prompt's keys and values are then held once for the n samples, whose decode steps read them
once per step for the group (Engine::prefill, PrefixSharing::shared, generator/engine.cpp).
transformers' generate with num_return_sequences=n repeats each prompt n times before its
prefill: one forward over prompts x n rows, left-padded to the longest prompt. The ratio
includes that saving, which is troupe's by design and grows with n and with the prompts' length.

troupe's line of bytes is a floor: the GEMM weights once per decode step for the whole batch,
and the keys and values each row attends over (a shared prompt once per group), against a
plain copy's bandwidth measured in the same run on the same device (bench/copy_bandwidth.hpp).

On a GPU, troupe's engine replays CUDA graphs of its decode step (its default there); the script
also times it decoding eagerly, and prints the graphs' speed-up.

--batch-invariant also times troupe with model.batch_invariant (the kernels that make its
log-probs the trainer's bit for bit): the price of exactness, as a ratio to troupe's default kernels.
"""
import argparse
import json
import os
import subprocess
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--troupe", default="build/troupe")
    p.add_argument("--bench", default="build/bench/bench_generate")
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--work", default="build/bench_models/smollm2")
    p.add_argument("--data", default="../shared/data/gsm8k/test.jsonl")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N], for both sides")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and activations, both sides")
    p.add_argument("--batch-invariant", action="store_true", help="also time troupe with model.batch_invariant (CPU)")
    args = p.parse_args()

    if not os.path.exists(os.path.join(args.work, "config.json")):
        subprocess.run([args.troupe, "convert", args.model, args.work], check=True)
    tok = AutoTokenizer.from_pretrained(args.work)
    with open(args.data) as f:
        questions = [json.loads(line)["question"] for line in f][: args.prompts]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in questions]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    def troupe_side(*extra):
        out = subprocess.run([args.bench, "--model", args.work, "--prompts", f.name, "--n", str(args.n),
                              "--max-tokens", str(args.max_tokens), "--max-batch", str(args.prompts * args.n),
                              "--device", args.device, "--dtype", args.dtype, *extra],
                             check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    ours = troupe_side()
    invariant = troupe_side("--batch-invariant") if args.batch_invariant else None
    # On a GPU troupe decodes with CUDA graphs (the engine's default there); eager is the same
    # engine launching every op, for the graphs' share of the ratio.
    eager = troupe_side("--decode", "eager") if args.device != "cpu" else None

    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.work, dtype=getattr(torch, args.dtype)).to(device).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(q) for q in prompts)
    ids = torch.tensor([[pad] * (width - len(q)) + q for q in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts], device=device)
    sample = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad)
    torch.manual_seed(0)
    with torch.inference_mode():
        # bench_generate's warm-up: the first prompt, greedy, 4 tokens (first-call set-up, caches)
        model.generate(input_ids=torch.tensor([prompts[0]], device=device), max_new_tokens=4, do_sample=False,
                       pad_token_id=pad)
        if device.type != "cpu":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        gen = model.generate(input_ids=ids, attention_mask=mask, num_return_sequences=args.n,
                             max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, **sample)
        if device.type != "cpu":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    hf_tokens = (gen.shape[1] - width) * gen.shape[0]
    theirs = {"tokens": hf_tokens, "seconds": seconds, "tokens_per_s": hf_tokens / seconds}

    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{torch.get_num_threads()} threads")
    print(f"generation {args.dtype}, {args.prompts} prompts x {args.n} samples x {args.max_tokens} new tokens, {where}")
    for name, r in (("troupe", ours), ("transformers", theirs)):
        print(f"{name + ':':14}{r['tokens_per_s']:9.1f} tokens/s ({r['tokens']} tokens in {r['seconds']:.1f} s)")
    print(f"ratio troupe / transformers: {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x")
    # troupe's decode steps against the bandwidth limit: the bytes they read at least per token
    # (bench/generate.cpp), at troupe's tokens/s, as a fraction of a plain copy's bytes/s.
    per_token = ours["weight_bytes_per_token"] + ours["kv_bytes_per_token"]
    bandwidth = ours["copy_bytes_per_s"]
    print(f"troupe's {args.dtype} weights (full) and keys/values: at least {per_token / 1e6:.2f} MB read per token "
          f"({ours['weight_bytes_per_token'] / 1e6:.2f} MB of weights, read once per decode step for the batch, "
          f"{ours['kv_bytes_per_token'] / 1e6:.2f} MB of keys and values); memory bandwidth (plain copy, read + write) "
          f"{bandwidth / 1e9:.1f} GB/s: {ours['tokens_per_s'] * per_token / bandwidth:.0%} of the limit "
          f"({bandwidth / per_token:.0f} tokens/s)")
    if eager:
        print(f"{'troupe, eager decode:':26}{eager['tokens_per_s']:9.1f} tokens/s ({eager['tokens']} tokens in "
              f"{eager['seconds']:.1f} s); CUDA graphs: {ours['graphs']} captured, {ours['tokens_per_s'] / eager['tokens_per_s']:.2f}x eager")
    if invariant:
        print(f"{'troupe, batch-invariant:':26}{invariant['tokens_per_s']:9.1f} tokens/s "
              f"({invariant['tokens']} tokens in {invariant['seconds']:.1f} s)")
        print(f"ratio batch-invariant / default kernels: {invariant['tokens_per_s'] / ours['tokens_per_s']:.2f}x; "
              f"/ transformers: {invariant['tokens_per_s'] / theirs['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
