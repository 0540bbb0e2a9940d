"""Forward throughput of SmolLM2-135M in float32, batch 8 x 256: troupe against transformers.

python bench/forward_throughput.py --troupe build/troupe --model models/SmolLM2-135M-Instruct.Q4_1.gguf
Converts the GGUF once with `troupe convert` so both sides run the same float32 weights, then
times the transformer trunk (embeddings to final norm, no LM head: troupe's forward stops
there by design) with the same thread count, and prints both sides and the ratio.
"""
import argparse
import json
import os
import subprocess
import time

import torch
from transformers import AutoModelForCausalLM


def troupe_side(bench, model, args):
    out = subprocess.run([bench, "--model", model, "--batch", str(args.batch), "--seq", str(args.seq),
                          "--iters", str(args.iters), "--dtype", args.dtype],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def transformers_side(model_dir, args):
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    with torch.inference_mode():
        model.model(input_ids=ids)  # warm-up
        start = time.perf_counter()
        for _ in range(args.iters):
            model.model(input_ids=ids)
        seconds = time.perf_counter() - start
    return {"tokens_per_s": args.batch * args.seq * args.iters / seconds, "seconds_per_forward": seconds / args.iters}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--troupe", default="build/troupe")
    p.add_argument("--bench", default="build/bench/bench_forward")
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--work", default="build/bench_models/smollm2")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()

    if not os.path.exists(os.path.join(args.work, "config.json")):
        subprocess.run([args.troupe, "convert", args.model, args.work], check=True)
    ours = troupe_side(args.bench, args.work, args)
    theirs = transformers_side(args.work, args)
    blas = "MKL" if torch.backends.mkl.is_available() else "no MKL"
    print(f"forward {args.dtype}, batch {args.batch} x {args.seq} tokens, {torch.get_num_threads()} threads "
          f"(transformers: {blas}, oneDNN {torch.backends.mkldnn.is_available()}; "
          f"troupe: {ours['threads']} threads, MKL {ours['mkl']}, oneDNN {ours['mkldnn']})")
    print(f"troupe:       {ours['tokens_per_s']:9.1f} tokens/s ({ours['seconds_per_forward']:.3f} s per forward)")
    print(f"transformers: {theirs['tokens_per_s']:9.1f} tokens/s ({theirs['seconds_per_forward']:.3f} s per forward)")
    print(f"ratio troupe / transformers: {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
