"""Data-parallel SFT of SmolLM2-135M at 2 ranks, 1 thread each: troupe (c10d Gloo, --sharding)
against PyTorch FSDP2 (fully_shard per decoder layer and the model, Gloo on CPU) on the same rows.

python bench/sft_parallel.py [--ranks 2 --batch 4 --seq 512 --steps 2 --warmup 1 --sharding zero2]
Both sides are started by torchrun, train the same GSM8K token rows (each rank its half of every
batch), AdamW lr 1e-5, gradients clipped to norm 1.0, loss on every token, float32. Prints the
job's tokens/s, each rank's peak RSS (VmHWM), both sides' step losses and the ratios. If FSDP2
cannot run here, the peer is DDP on Gloo, and the output says so.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sft_throughput import make_rows, peak_rss_mib  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_child(args):
    """One rank of the PyTorch side (under torchrun)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(args.work, dtype=torch.float32)
    peer = "FSDP2 (fully_shard)"
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    except Exception as e:  # noqa: BLE001 - reported, then the documented fallback
        peer = f"DDP (FSDP2 failed on CPU: {type(e).__name__}: {e})"
        model = torch.nn.parallel.DistributedDataParallel(model)
    with open(args.rows) as f:
        rows = json.load(f)
    first, last = args.batch * rank // world, args.batch * (rank + 1) // world
    batches = [torch.tensor(rows[s * args.batch + first:s * args.batch + last]) for s in range(args.warmup + args.steps)]
    rss_loaded = peak_rss_mib("VmRSS")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for s, ids in enumerate(batches):
        if s == args.warmup:
            dist.barrier()
            start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss  # rows of equal length: the mean of rank means is the global mean
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
    dist.barrier()
    seconds = time.perf_counter() - start
    tokens = args.steps * args.batch * args.seq
    print(json.dumps({"rank": rank, "tokens_per_s": tokens / seconds, "seconds_per_step": seconds / args.steps,
                      "losses": losses, "rss_loaded_mib": rss_loaded, "peak_rss_mib": peak_rss_mib(),
                      "peer": peer, "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


def torchrun(args, command):
    runner = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [runner, "--nproc-per-node", str(args.ranks), "--master-port", str(free_port())] + command
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    ranks = {}
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            ranks[r["rank"]] = r
    if len(ranks) != args.ranks:
        raise SystemExit(f"expected {args.ranks} result lines, got {len(ranks)}:\n{out}")
    return [ranks[r] for r in range(args.ranks)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--troupe", default="build/troupe")
    p.add_argument("--bench", default="build/bench/bench_sft")
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--work", default="build/bench_models/smollm2")
    p.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--sharding", default="zero2", choices=["none", "zero1", "zero2", "zero3"])
    p.add_argument("--no-prefetch", action="store_true", help="zero3: troupe gathers each layer only when it computes")
    p.add_argument("--child", choices=["peer"], help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return peer_child(args)

    if not os.path.exists(os.path.join(args.work, "config.json")):
        subprocess.run([args.troupe, "convert", args.model, args.work], check=True)
    rows = make_rows(args, args.batch * (args.warmup + args.steps))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(rows, f)
    common = ["--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--lr", str(args.lr), "--max-grad-norm", str(args.max_grad_norm)]
    try:
        ours = torchrun(args, ["--no-python", args.bench, "--model", args.work, "--rows", f.name, "--threads", "1",
                               "--sharding", args.sharding] + (["--no-prefetch"] if args.no_prefetch else []) + common)
        theirs = torchrun(args, [__file__, "--child", "peer", "--work", args.work, "--rows", f.name,
                                 "--seq", str(args.seq)] + common)
    finally:
        os.unlink(f.name)
    print(f"SFT float32 at {args.ranks} ranks x 1 thread, global batch {args.batch} x {args.seq} tokens, "
          f"{args.warmup} warm-up + {args.steps} timed steps, AdamW lr {args.lr}, clip {args.max_grad_norm}; "
          f"troupe sharding {args.sharding}{' without prefetch' if args.no_prefetch else ''} (Gloo), peer {theirs[0]['peer']} (torch {theirs[0]['torch']})")
    for name, side in (("troupe", ours), ("peer", theirs)):
        rss = ", ".join(f"rank {r['rank']} {r['peak_rss_mib']:.0f} MiB" for r in side)
        print(f"{name + ':':8}{side[0]['tokens_per_s']:8.1f} tokens/s ({side[0]['seconds_per_step']:.1f} s/step), "
              f"peak RSS {rss}, losses {' '.join(f'{x:.4f}' for x in side[0]['losses'])}")
    speed = ours[0]["tokens_per_s"] / theirs[0]["tokens_per_s"]
    memory = max(r["peak_rss_mib"] for r in ours) / max(r["peak_rss_mib"] for r in theirs)
    print(f"ratio troupe / peer: speed {speed:.2f}x, peak memory per rank {memory:.2f}x")


if __name__ == "__main__":
    main()
