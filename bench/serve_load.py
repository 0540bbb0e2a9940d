"""Load on `troupe serve`: many concurrent clients sending /v1/completions, SmolLM2-135M on CPU.

python bench/serve_load.py [--clients 64 --requests 4 --max-tokens 32 --max-batch 64]
Starts `troupe serve` on a free loopback port, waits for /health, then each client thread
sends its requests one after another (temperature 1, a seed per request, EOS ignored so every
completion has max-tokens tokens). Prints requests/s, completion tokens/s, latency percentiles
and the error count; exits 1 if any request failed. The server is stopped with SIGTERM at the end.
Client side is the standard library only; all traffic stays on 127.0.0.1.
"""
import argparse
import http.client
import json
import math
import signal
import subprocess
import sys
import threading
import time

PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nName three colours and one fruit of each colour.<|im_end|>\n<|im_start|>assistant\n")


def start_server(args):
    cmd = [args.troupe, "serve", "--model", args.model, "--port", "0", "--max-batch", str(args.max_batch),
           "--max-seq-len", str(args.max_seq_len), "--dtype", args.dtype]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    prefix = "troupe serve: listening on http://127.0.0.1:"
    lines = []
    for line in proc.stdout:  # model loading happens before the listening line
        lines.append(line)
        if line.startswith(prefix):
            port = int(line[len(prefix):].strip().rstrip("/"))
            # keep draining the server's output so it never blocks on a full pipe
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, port
    proc.wait()
    sys.exit(f"troupe serve exited with {proc.returncode} before listening:\n{''.join(lines)}")


def wait_healthy(port, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"troupe serve on port {port}: /health did not answer 200 within {timeout:.0f} s")


def client(port, index, args, latencies, tokens, errors, lock):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=args.timeout)
    for r in range(args.requests):
        body = json.dumps({"model": args.model, "prompt": PROMPT, "max_tokens": args.max_tokens,
                           "temperature": 1.0, "seed": index * args.requests + r, "ignore_eos": True})
        start = time.perf_counter()
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            seconds = time.perf_counter() - start
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")
            n = json.loads(data)["usage"]["completion_tokens"]
            with lock:
                latencies.append(seconds)
                tokens.append(n)
        except Exception as e:  # count every failure, keep the client going on a fresh connection
            with lock:
                errors.append(f"client {index} request {r}: {type(e).__name__}: {e}")
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=args.timeout)
    conn.close()


def percentile(sorted_values, q):
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values), max(1, math.ceil(q / 100 * len(sorted_values)))) - 1  # nearest rank
    return sorted_values[i]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--troupe", default="build/troupe")
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=4, help="requests per client, sent one after another")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=64, help="passed to troupe serve")
    p.add_argument("--max-seq-len", type=int, default=512, help="passed to troupe serve")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    args = p.parse_args()

    proc, port = start_server(args)
    try:
        wait_healthy(port)
        latencies, tokens, errors, lock = [], [], [], threading.Lock()
        threads = [threading.Thread(target=client, args=(port, i, args, latencies, tokens, errors, lock))
                   for i in range(args.clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    lat = sorted(latencies)
    total = args.clients * args.requests
    print(f"troupe serve {args.dtype}, --max-batch {args.max_batch}: {args.clients} clients x {args.requests} "
          f"requests x {args.max_tokens} tokens (temperature 1, EOS ignored), loopback")
    print(f"requests:  {len(lat)}/{total} ok in {seconds:.1f} s: {len(lat) / seconds:.2f} requests/s, "
          f"{sum(tokens) / seconds:.1f} completion tokens/s")
    print("latency:   " + ", ".join(f"p{q} {percentile(lat, q):.2f} s" for q in (50, 90, 99))
          + f", max {lat[-1] if lat else float('nan'):.2f} s")
    print(f"ERRORS:    {len(errors)}" + ("" if errors else " (ok)"))
    for e in errors[:10]:
        print("  " + e)
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
