"""Serving SmolLM2-135M on CPU under load: `troupe serve` against llama-cpp-python's server on the same GGUF.

python bench/serve_load.py [--clients 64 --requests 4 --max-tokens 32 --max-batch 64 --threads 2]
Starts each server in turn on a free loopback port with the same threads (OMP_NUM_THREADS for
troupe, --n_threads and --n_threads_batch for llama.cpp), sends one warm-up request outside the
timing, then each client thread sends its requests one after another: the same prompt, temperature
1, top-p 1, no top-k, min-p or repetition penalty, a seed per request, max-tokens tokens each with
EOS ignored (troupe: ignore_eos; llama-cpp-python has no such field, so its end-of-generation
tokens get a logit bias of -1e9). Prints requests/s, completion tokens/s, latency percentiles and
errors for each, then the ratios; exits 1 if any request failed. Servers are stopped with SIGTERM.
Token rates count the completion tokens each server reports: llama-cpp-python checks max_tokens only
after a character is complete, so a completion ending inside a multi-byte one runs a token or two over.

Not like for like, and part of what is measured: troupe batches up to --max-batch concurrent
requests into one decode step, while llama-cpp-python's server answers one request at a time and
keeps the shared prompt's KV cache from one request to the next (its prefix match), so it skips
most of each prefill. llama.cpp computes with the Q4_1 blocks as stored; troupe dequantizes them to
--dtype at load. Client side is the standard library only; all traffic stays on 127.0.0.1.
"""
import argparse
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nName three colours and one fruit of each colour.<|im_end|>\n<|im_start|>assistant\n")


def drain(proc):  # keep reading the server's output so it never blocks on a full pipe
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()


def start_troupe(args):
    cmd = [args.troupe, "serve", "--model", args.model, "--port", "0", "--max-batch", str(args.max_batch),
           "--max-seq-len", str(args.max_seq_len), "--dtype", args.dtype]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    prefix = "troupe serve: listening on http://127.0.0.1:"
    lines = []
    for line in proc.stdout:  # model loading happens before the listening line
        lines.append(line)
        if line.startswith(prefix):
            drain(proc)
            return proc, int(line[len(prefix):].strip().rstrip("/")), "/health"
    proc.wait()
    sys.exit(f"troupe serve exited with {proc.returncode} before listening:\n{''.join(lines)}")


def start_llamacpp(args):
    with socket.socket() as s:  # llama-cpp-python takes no port 0: pick a free one and hand it over
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", str(args.max_seq_len), "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads)]
    if amx():  # llama-cpp-python 0.3.36 on AMX dies on prompts of more than one token (tests/generator/test_remote_engine.cpp)
        cmd += ["--n_ubatch", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    drain(proc)
    return proc, port, "/v1/models"  # uvicorn listens only once the model is loaded


def amx():
    with open("/proc/cpuinfo") as f:
        return "amx_tile" in f.read()


def end_of_generation_ids(model):
    """The ids at which llama-cpp-python stops (llama_vocab_is_eog), read from the GGUF's vocabulary."""
    import llama_cpp
    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return [i for i in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, i)]


def wait_ready(proc, port, path, name, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{name} exited with {proc.returncode} before answering {path}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"{name} on port {port}: {path} did not answer 200 within {timeout:.0f} s")


def post(conn, body):
    """One completion; returns its completion token count, raises on any failure."""
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")
    return json.loads(data)["usage"]["completion_tokens"]


def client(port, index, args, body, out, lock):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=args.timeout)
    for r in range(args.requests):
        start = time.perf_counter()
        try:
            n = post(conn, body(index * args.requests + r))
            with lock:
                out["latencies"].append(time.perf_counter() - start)
                out["tokens"].append(n)
        except Exception as e:  # count every failure, keep the client going on a fresh connection
            with lock:
                out["errors"].append(f"client {index} request {r}: {type(e).__name__}: {e}")
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=args.timeout)
    conn.close()


def load(name, start, body, args):
    """Starts the server, warms it up, runs every client against it, stops it."""
    proc, port, ready = start(args)
    try:
        wait_ready(proc, port, ready, name)
        warm = http.client.HTTPConnection("127.0.0.1", port, timeout=args.timeout)
        post(warm, body(args.clients * args.requests))  # a seed no client uses
        warm.close()
        out, lock = {"latencies": [], "tokens": [], "errors": []}, threading.Lock()
        threads = [threading.Thread(target=client, args=(port, i, args, body, out, lock)) for i in range(args.clients)]
        start_s = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["seconds"] = time.perf_counter() - start_s
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out["name"] = name
    out["latencies"].sort()
    return out


def percentile(sorted_values, q):
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values), max(1, math.ceil(q / 100 * len(sorted_values)))) - 1  # nearest rank
    return sorted_values[i]


def report(r, total):
    lat = r["latencies"]
    print(f"{r['name']}:")
    print(f"  requests:  {len(lat)}/{total} ok in {r['seconds']:.1f} s: {len(lat) / r['seconds']:.2f} requests/s, "
          f"{sum(r['tokens']) / r['seconds']:.1f} completion tokens/s ({sum(r['tokens'])} tokens)")
    print("  latency:   " + ", ".join(f"p{q} {percentile(lat, q):.2f} s" for q in (50, 90, 99))
          + f", max {lat[-1] if lat else float('nan'):.2f} s")
    print(f"  ERRORS:    {len(r['errors'])}" + ("" if r["errors"] else " (ok)"))
    for e in r["errors"][:10]:
        print("    " + e)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--troupe", default="build/troupe")
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=4, help="requests per client, sent one after another")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=64, help="passed to troupe serve")
    p.add_argument("--max-seq-len", type=int, default=512, help="troupe serve's --max-seq-len, llama.cpp's --n_ctx")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="compute threads of each server")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="troupe's side")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    args = p.parse_args()

    common = {"model": args.model, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 1.0, "top_p": 1.0}
    ban = {str(i): -1e9 for i in end_of_generation_ids(args.model)}
    ours = load("troupe serve", start_troupe, lambda seed: {**common, "seed": seed, "ignore_eos": True}, args)
    theirs = load("llama-cpp-python server", start_llamacpp,
                  lambda seed: {**common, "seed": seed, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0,
                                "logit_bias": ban}, args)

    total = args.clients * args.requests
    print(f"serving {args.clients} clients x {args.requests} requests x {args.max_tokens} tokens (temperature 1, "
          f"EOS ignored), loopback, {args.threads} threads; troupe {args.dtype} --max-batch {args.max_batch}, "
          f"llama.cpp Q4_1" + (" --n_ubatch 1 (AMX)" if amx() else ""))
    for r in (ours, theirs):
        report(r, total)
    if ours["latencies"] and theirs["latencies"]:
        tokens = sum(ours["tokens"]) / ours["seconds"] / (sum(theirs["tokens"]) / theirs["seconds"])
        requests = len(ours["latencies"]) / ours["seconds"] / (len(theirs["latencies"]) / theirs["seconds"])
        p50 = percentile(ours["latencies"], 50) / percentile(theirs["latencies"], 50)
        print(f"ratio troupe / llama-cpp-python: {tokens:.2f}x completion tokens/s, {requests:.2f}x requests/s; "
              f"p50 latency {p50:.2f}x")
    if ours["errors"] or theirs["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
