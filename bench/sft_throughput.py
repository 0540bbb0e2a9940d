"""SFT training throughput and peak memory of SmolLM2-135M, rows of 512 tokens: troupe against transformers.

python bench/sft_throughput.py [--batch 4 --seq 512 --steps 2 --warmup 1 --dtypes float32]
GSM8K training text (question, answer, eos), tokenized once and cut into rows of seq tokens,
is written to a JSON file that both sides read, so both train on the same token ids. Each side
runs in its own process: load the weights, warm-up steps, then timed steps of AdamW (lr 1e-5,
no weight decay) with the gradient clipped to norm 1.0 and the loss on every token, one
micro-batch per step, on the same number of threads. Prints tokens/s, CPU seconds per step (less
sensitive than wall time to other load on the machine) and peak RSS (VmHWM) of each side, the
ratios, and each side's step losses (they should agree: same data, same weights).
troupe also runs once with activation checkpointing. transformers computes the full
[B, T, vocab] logits; troupe's log-probs are computed in chunks of positions.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def peak_rss_mib(field="VmHWM"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return -1.0


def transformers_child(args):
    """The transformers side, in a process of its own so its peak RSS is its own."""
    import torch
    from transformers import AutoModelForCausalLM

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.work, dtype=dtype)
    with open(args.rows) as f:
        rows = json.load(f)
    batches = [torch.tensor(rows[s * args.batch:(s + 1) * args.batch]) for s in range(args.warmup + args.steps)]
    rss_loaded = peak_rss_mib("VmRSS")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    start = time.perf_counter()
    for s, ids in enumerate(batches):
        if s == args.warmup:
            start, cpu_start = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = args.steps * args.batch * args.seq
    print(json.dumps({"tokens_per_s": tokens / seconds, "seconds_per_step": seconds / args.steps,
                      "cpu_seconds_per_step": cpu_seconds / args.steps, "losses": losses,
                      "rss_loaded_mib": rss_loaded, "peak_rss_mib": peak_rss_mib(), "threads": torch.get_num_threads(),
                      "mkl": torch.backends.mkl.is_available(), "mkldnn": torch.backends.mkldnn.is_available(),
                      "version": __import__("transformers").__version__}))


def make_rows(args, count):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.work)
    eos = tok.eos_token_id
    stream, rows = [], []
    with open(args.data) as f:
        for line in f:
            r = json.loads(line)
            stream += tok(r["question"] + "\n" + r["answer"], add_special_tokens=False)["input_ids"] + [eos]
            while len(stream) >= args.seq and len(rows) < count:
                rows.append(stream[:args.seq])
                stream = stream[args.seq:]
            if len(rows) == count:
                return rows
    raise SystemExit(f"{args.data}: only {len(rows)} rows of {args.seq} tokens, need {count}")


def run_child(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--troupe", default="build/troupe")
    p.add_argument("--bench", default="build/bench/bench_sft")
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--work", default="build/bench_models/smollm2")
    p.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="0: LibTorch's default on both sides")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--dtypes", default="float32", help="comma-separated: float32,bfloat16")
    p.add_argument("--no-checkpointing", action="store_true", help="skip troupe's activation-checkpointing run")
    p.add_argument("--child", choices=["transformers"], help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return transformers_child(args)

    if not os.path.exists(os.path.join(args.work, "config.json")):
        subprocess.run([args.troupe, "convert", args.model, args.work], check=True)
    rows = make_rows(args, args.batch * (args.warmup + args.steps))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(rows, f)
    common = ["--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--lr", str(args.lr), "--max-grad-norm", str(args.max_grad_norm)]
    try:
        for dtype in args.dtypes.split(","):
            ours = run_child([args.bench, "--model", args.work, "--rows", f.name, "--dtype", dtype,
                              "--threads", str(args.threads)] + common)
            threads = ours["threads"]  # the transformers side runs on exactly as many
            ckpt = None if args.no_checkpointing else run_child(
                [args.bench, "--model", args.work, "--rows", f.name, "--dtype", dtype, "--threads", str(threads),
                 "--activation-checkpointing"] + common)
            theirs = run_child([sys.executable, __file__, "--child", "transformers", "--work", args.work,
                                "--rows", f.name, "--dtype", dtype, "--threads", str(threads), "--seq", str(args.seq)]
                               + common)
            print(f"SFT {dtype}, batch {args.batch} x {args.seq} tokens, {args.warmup} warm-up + {args.steps} timed "
                  f"steps, AdamW lr {args.lr}, clip {args.max_grad_norm}, {threads} threads "
                  f"(transformers {theirs['version']}: MKL {theirs['mkl']}, oneDNN {theirs['mkldnn']}, "
                  f"{theirs['threads']} threads; troupe: MKL {ours['mkl']}, oneDNN {ours['mkldnn']})")
            sides = [("troupe", ours)] + ([("troupe ckpt", ckpt)] if ckpt else []) + [("transformers", theirs)]
            for name, r in sides:
                print(f"{name + ':':14}{r['tokens_per_s']:8.1f} tokens/s ({r['seconds_per_step']:.1f} s/step, "
                      f"{r['cpu_seconds_per_step']:.1f} CPU s/step), "
                      f"peak RSS {r['peak_rss_mib']:7.0f} MiB (after load {r['rss_loaded_mib']:.0f}), "
                      f"losses {' '.join(f'{x:.4f}' for x in r['losses'])}")
            for name, r in sides[:-1]:
                print(f"ratio {name} / transformers: speed {r['tokens_per_s'] / theirs['tokens_per_s']:.2f}x "
                      f"(by CPU time {theirs['cpu_seconds_per_step'] / r['cpu_seconds_per_step']:.2f}x), "
                      f"peak memory {r['peak_rss_mib'] / theirs['peak_rss_mib']:.2f}x")
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    main()
