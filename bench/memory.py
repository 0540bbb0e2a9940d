"""Peak memory of an async GRPO run, with what its parts take: the demo's config in float32 by default.

python bench/memory.py [--config configs/demo.yaml] [--dtype float32] [--steps 4]

Runs `troupe run` for --steps steps and samples its VmRSS and VmHWM (the kernel's peak) every 0.2 s,
and the weight files it hands its generators through /dev/shm (not in RSS, but memory all the same).
Then the parts the run needs, each computed from the run's own outputs, not from troupe's code:
- weights: the bytes of one copy of the policy (`weights/bytes` in metrics.jsonl), held by the
  trainer and by each generator's engine;
- gradients: one more copy; the optimizer's state: the size of the checkpoint's optimizer.pt
  (AdamW: two moments, two more copies);
- KV cache: generator.max_batch x generator.max_seq_len x layers x 2 (keys, values) x kv heads x
  head dim x the dtype's bytes, per generator (from the checkpoint's config.json);
- activations: what PyTorch's autograd saves for the backward pass of one micro-batch through the
  same model in transformers (saved_tensors_hooks over the decoder, the LM head and loss left out:
  troupe's log-probs are chunked), for trainer.micro_batch rows of the run's longest sequence;
- runtime: the peak RSS of the same binary on the tiny arithmetic task (LibTorch, CAF, threads,
  a 2-layer model).
It prints the peak, the parts and their sum, and the ratio peak / sum (issue 14's goal: at most
1.5). The weight files in /dev/shm are reported beside the peak.
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1e6


def status_kb(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def shm_bytes(pid):
    total = 0
    for path in glob.glob(f"/dev/shm/troupe-weights-{pid}-*/**", recursive=True):
        if os.path.isfile(path):
            total += os.path.getsize(path)
    return total


def poll(pid, out, stop):
    while not stop.is_set():
        try:
            out.append((time.monotonic(), status_kb(pid, "VmRSS") * 1024, status_kb(pid, "VmHWM") * 1024, shm_bytes(pid)))
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.2)


def run_peak(cmd):
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples, stop = [], threading.Event()
    poller = threading.Thread(target=poll, args=(proc.pid, samples, stop))
    poller.start()
    log = proc.stdout.read()
    rc = proc.wait()
    stop.set()
    poller.join()
    if rc != 0:
        print(log)
        sys.exit(f"{' '.join(cmd)}: exited {rc}")
    return samples


def runtime_bytes(troupe):
    """The peak RSS of the same binary running the tiny arithmetic task (a 2-layer, hidden-64 model)."""
    fixtures = os.path.join(ROOT, "build", "fixtures", "arithmetic")
    with tempfile.TemporaryDirectory(prefix="troupe_memory_tiny_") as run_dir:
        samples = run_peak([troupe, "run", "configs/tiny_arithmetic_grpo.yaml", f"model.path={fixtures}/model",
                            f"data.train.path={fixtures}/train.jsonl", f"trainer.sft_warmup.path={fixtures}/format.jsonl",
                            "trainer.steps=2", f"run.dir={run_dir}"])
    return max(s[2] for s in samples)


def activations_bytes(model_dir, rows, length):
    """Bytes autograd saves for the decoder's backward pass (parameters excluded), in transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (rows, length))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model.model(input_ids=ids).last_hidden_state
    del hidden
    return sum(seen.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--troupe", default=os.path.join(ROOT, "build", "troupe"))
    args = ap.parse_args()

    run_dir = tempfile.mkdtemp(prefix="troupe_memory_")
    cmd = [args.troupe, "run", args.config, f"model.dtype={args.dtype}", f"trainer.steps={args.steps}",
           f"run.dir={run_dir}"]
    print("running:", " ".join(cmd), flush=True)
    samples = run_peak(cmd)
    peak = max(s[2] for s in samples)
    print(f"peak RSS {peak / MB:.1f} MB", flush=True)
    runtime = runtime_bytes(args.troupe)
    shm_peak = max(s[3] for s in samples)

    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    weights = max(m.get("weights/bytes", 0) for m in metrics)  # the steps that sent weights say their size
    import yaml  # a dependency of transformers

    run_config = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    ckpt = os.path.join(run_dir, "checkpoints", f"step_{args.steps}")
    model_config = json.load(open(os.path.join(ckpt, "config.json")))
    gen, trainer = run_config["generator"], run_config["trainer"]
    generators = int(gen.get("count", 1))
    elem = {"float32": 4, "bfloat16": 2}[args.dtype]
    heads = model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // heads
    kv = gen["max_batch"] * gen["max_seq_len"] * model_config["num_hidden_layers"] * 2 * \
        model_config["num_key_value_heads"] * head_dim * elem

    from transformers import AutoTokenizer

    # troupe writes it with LibTorch's torch::save: a zip of the state's tensors, stored uncompressed.
    moments = os.path.getsize(os.path.join(ckpt, "optimizer.pt"))

    tok = AutoTokenizer.from_pretrained(ckpt)
    longest = 0
    for line in open(os.path.join(run_dir, "samples.jsonl")):
        for s in json.loads(line)["samples"]:
            longest = max(longest, len(tok(s["prompt"], add_special_tokens=False).input_ids))
    length = longest + int(gen["max_tokens"])
    activations = activations_bytes(ckpt, int(trainer["micro_batch"]), length)

    parts = [
        ("runtime (the tiny task's peak: libraries, threads, a 2-layer model)", runtime),
        ("trainer weights", weights),
        ("gradients", weights),
        ("optimizer state (the size of the checkpoint's optimizer.pt)", moments),
        (f"generator weights x {generators}", weights * generators),
        (f"KV cache x {generators} ({gen['max_batch']} x {gen['max_seq_len']} tokens)", kv * generators),
        (f"activations ({trainer['micro_batch']} x {length} tokens, autograd's saved tensors in transformers)", activations),
    ]
    total = sum(b for _, b in parts)
    print(f"\n{args.config}, model.dtype={args.dtype}, {args.steps} steps")
    for name, b in parts:
        print(f"  {name:<90s} {b / MB:9.1f} MB")
    print(f"  {'sum of the parts':<90s} {total / MB:9.1f} MB")
    print(f"  {'peak RSS (VmHWM)':<90s} {peak / MB:9.1f} MB")
    print(f"  {'weight files in /dev/shm at most (not in RSS)':<90s} {shm_peak / MB:9.1f} MB")
    print(f"peak / sum = {peak / total:.2f} (goal: at most 1.5)")
    print(json.dumps({"peak_bytes": peak, "sum_bytes": total, "ratio": peak / total, "shm_bytes": shm_peak,
                      "parts": {n: b for n, b in parts}}))
    shutil.rmtree(run_dir)


if __name__ == "__main__":
    main()
