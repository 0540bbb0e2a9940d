"""Single-sequence greedy decode of SmolLM2-135M-Instruct on CPU: troupe against llama.cpp.

python bench/decode_llamacpp.py [--max-tokens 128 --dtype float32 --weights full|int8|int4]
Both sides read the same GGUF and decode the same prompt token ids greedily, one sequence,
to exactly max-tokens new tokens (EOS ignored), on the same number of threads. Times the
decode steps only (the prefill is reported apart); prints tokens/s for each and the ratio.
Weights: llama.cpp computes with the Q4_1 blocks as stored; troupe dequantizes them to float32
(or bfloat16) at load, then decodes with those (--weights full) or with a weight-only int8 or
int4 copy (generator.weights; int4 is Q4_1's layout, 32 weights per scale and zero point):
over float32 activations its codes go through troupe's few-row kernel, over bfloat16 through
ATen's packed kernels.
Decode at this size is bound by memory bandwidth, so both sides' results are also given as a
fraction of the limit: weight bytes read per token against a plain copy's bytes/s measured in
the same run (troupe counts its GEMM weights; llama.cpp's are taken as the GGUF's tensor bytes).
"""
import argparse
import json
import os
import subprocess
import time

import llama_cpp
import numpy as np

PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n")


def llamacpp_side(llm, prompt, args):
    n_vocab = llm.n_vocab()

    def step(tokens):  # llama.cpp forward over `tokens`, then our own argmax of the last logits
        llm.eval(tokens)
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(n_vocab,))))

    llm.reset()
    tok = step(prompt)  # warm-up, as troupe's side does one
    for _ in range(3):
        tok = step([tok])
    llm.reset()
    start = time.perf_counter()
    ids = [step(prompt)]
    first = time.perf_counter()
    for _ in range(args.max_tokens - 1):
        ids.append(step([ids[-1]]))
    decode_s = time.perf_counter() - first
    steps = args.max_tokens - 1
    return {"tokens_per_s": steps / decode_s, "ms_per_token": 1e3 * decode_s / steps,
            "prefill_ms": 1e3 * (first - start), "ids": ids}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", default="build/bench/bench_decode")
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="both sides; 0: LibTorch's default on troupe's side")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="troupe's side")
    p.add_argument("--weights", default="full", choices=["full", "int8", "int4"], help="troupe's side")
    p.add_argument("--no-pack", action="store_true",
                   help="troupe's side, full weights: the plain weights, not the packed oneDNN copies (for an A/B)")
    args = p.parse_args()

    llm = llama_cpp.Llama(model_path=args.model, n_ctx=1024, verbose=False)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
    if len(prompt) + args.max_tokens > llm.n_ctx():
        p.error(f"--max-tokens {args.max_tokens}: prompt + completion must fit llama.cpp's n_ctx {llm.n_ctx()}")

    out = subprocess.run([args.bench, "--model", args.model, "--prompt-ids", ",".join(map(str, prompt)),
                          "--max-tokens", str(args.max_tokens), "--threads", str(args.threads), "--dtype", args.dtype,
                          "--weights", args.weights] + (["--no-pack"] if args.no_pack else []),
                         check=True, capture_output=True, text=True).stdout
    ours = json.loads(out.strip().splitlines()[-1])

    threads = ours["threads"]  # llama.cpp gets the threads troupe's side actually ran on
    llama_cpp.llama_set_n_threads(llm.ctx, threads, threads)
    theirs = llamacpp_side(llm, prompt, args)

    same = next((i for i, (a, b) in enumerate(zip(ours["ids"], theirs["ids"])) if a != b), args.max_tokens)
    bandwidth = ours["copy_bytes_per_s"]
    ours["bytes_per_token"] = ours["weight_bytes_per_token"]
    theirs["bytes_per_token"] = os.path.getsize(args.model)  # tensor bytes, plus a small header
    print(f"greedy decode, 1 sequence, {len(prompt)} prompt tokens + {args.max_tokens} new tokens, {threads} threads; "
          f"weights: llama.cpp computes with Q4_1, troupe with {args.weights} weights over {args.dtype} activations")
    print(f"CPU: bfloat16 {ours['cpu_bf16']}; memory bandwidth (plain copy, read + write): {bandwidth / 1e9:.1f} GB/s")
    if args.weights != "full" and args.dtype == "float32":
        print(f"troupe's {args.weights} GEMMs of one row: troupe's own kernel over the codes ({ours['few_rows']})")
    elif args.weights != "full":
        print(f"troupe's {args.weights} GEMMs: ATen's packed kernel over {args.dtype} activations")
    if args.weights != "full":
        print(f"troupe's requantization at a weight sync (every GEMM's kept copy): {ours['quantize_s']:.3f} s")
    elif ours["packed"]:
        print(f"troupe's {args.dtype} weights packed for oneDNN (at a weight sync too): {ours['quantize_s']:.3f} s")
    for name, r in (("troupe", ours), ("llama.cpp", theirs)):
        limit = bandwidth / r["bytes_per_token"]
        print(f"{name + ':':11}{r['tokens_per_s']:8.1f} tokens/s ({r['ms_per_token']:.2f} ms per token, "
              f"prefill {r['prefill_ms']:.0f} ms); {r['bytes_per_token'] / 1e6:.1f} MB of weights per token, "
              f"{r['tokens_per_s'] / limit:.0%} of the bandwidth limit ({limit:.0f} tokens/s)")
    print(f"ratio troupe / llama.cpp: {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x")
    print(f"greedy tokens agree for the first {same} of {args.max_tokens} (the weights differ, see above)")


if __name__ == "__main__":
    main()
