"""Soak: a long `troupe serve` under a mixed load, or a long tiny async GRPO run; RSS and open files.

python bench/soak.py serve --minutes 30 [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
python bench/soak.py grpo  --minutes 60 [--config configs/tiny_arithmetic_grpo.yaml]

Samples the process's resident memory (VmRSS) and its open file descriptors (/proc/PID/fd) every
--every seconds, prints each sample, then the first and last, and the least-squares slope over the
whole run and over its second half (after warm-up: allocator pools, caches and the first checkpoint
settle early). It exits 1 when the second half's slope says the process grows without bound: RSS
faster than --max-rss-slope MB per hour, or open files ending more than --fd-margin above the first half's peak.

serve: one compute thread, the real model, four client threads for the whole run, each looping
over a mix: plain and chat completions, n > 1 with a seed, streams read to the end, streams
dropped after the first chunk (the server must free their slots), /tokenize and /detokenize,
malformed bodies (400s), and a fresh TCP connection for every tenth request. Every answer is
checked; a wrong status or a lost connection counts as an error, and errors fail the run.

grpo: `troupe run` of the tiny arithmetic task (the build's fixtures, as its config says) for the
whole duration with a checkpoint every --checkpoint-every steps and the live dashboard polled once
a second; then SIGTERM, which must end it with its status written as stopped.
Client side is the standard library only; all traffic stays on 127.0.0.1.
"""
import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

PROMPT = "Name three colours and one fruit of each colour."


def sample(pid):
    rss_kb = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
    return rss_kb / 1024.0, len(os.listdir(f"/proc/{pid}/fd"))


def slope(points):
    """Least-squares slope of (t seconds, value) points, per hour."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return 3600.0 * sum((t - mt) * (v - mv) for t, v in points) / den if den else 0.0


def start(cmd, env, prefix):
    """Starts `cmd`, reads its output until a line starting with `prefix`; returns (proc, rest of that line)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        at = line.find(prefix)
        if at >= 0:
            log = []
            threading.Thread(target=lambda: [log.append(x) for x in proc.stdout], daemon=True).start()
            proc.log = log
            return proc, line[at + len(prefix):].strip()
    proc.wait()
    sys.exit(f"{cmd[0]} {cmd[1]} exited with {proc.returncode} before printing '{prefix}':\n{''.join(seen)}")


class Mix:
    """The serve load: one client thread's loop over the request kinds."""
    KINDS = ["completion", "chat", "n_seed", "stream", "stream_dropped", "tokenize", "malformed"]

    def __init__(self, port, stop, timeout):
        self.port, self.stop, self.timeout = port, stop, timeout
        self.counts = {k: 0 for k in self.KINDS}
        self.errors = []
        self.lock = threading.Lock()

    def request(self, conn, path, body, raw=False):
        data = body if raw else json.dumps(body)
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        return conn.getresponse()

    def one(self, conn, kind, i):
        if kind == "completion":
            r = self.request(conn, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": i})
            body = json.loads(r.read())
            assert r.status == 200 and body["choices"][0]["text"] is not None, (r.status, body)
        elif kind == "chat":
            r = self.request(conn, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                            "max_tokens": 16, "temperature": 0})
            body = json.loads(r.read())
            assert r.status == 200 and body["choices"][0]["message"]["role"] == "assistant", (r.status, body)
        elif kind == "n_seed":
            r = self.request(conn, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "n": 4, "seed": i, "logprobs": 1})
            body = json.loads(r.read())
            assert r.status == 200 and len(body["choices"]) == 4, (r.status, body)
        elif kind in ("stream", "stream_dropped"):
            r = self.request(conn, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "stream": True, "seed": i})
            assert r.status == 200, r.status
            if kind == "stream_dropped":
                r.fp.readline()  # the first event, then hang up mid-generation
                conn.close()
                return
            text = r.read().decode()
            assert text.rstrip().endswith("data: [DONE]"), text[-200:]
        elif kind == "tokenize":
            r = self.request(conn, "/tokenize", {"prompt": PROMPT})
            ids = json.loads(r.read())["tokens"]
            r = self.request(conn, "/detokenize", {"tokens": ids})
            assert json.loads(r.read())["prompt"] == PROMPT
        elif kind == "malformed":
            r = self.request(conn, "/v1/completions", b'{"prompt": "x", "max_tokens": ', raw=True)
            r.read()
            assert r.status == 400, r.status

    def client(self, index):
        conn, i = None, index * 1_000_000
        while not self.stop.is_set():
            kind = self.KINDS[i % len(self.KINDS)]
            if conn is None or i % 10 == 0:
                if conn:
                    conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            try:
                self.one(conn, kind, i)
                with self.lock:
                    self.counts[kind] += 1
                if kind == "stream_dropped":
                    conn = None
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                with self.lock:
                    self.errors.append(f"{kind} #{i}: {type(e).__name__}: {e}"[:300])
                conn.close()
                conn = None
            i += 1
        if conn:
            conn.close()


def get(port, path, timeout=10):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def watch(proc, args, on_tick=None):
    """Samples `proc` every args.every seconds for args.minutes; returns [(t, rss_mb, fds)]."""
    t0 = time.monotonic()
    points = []
    next_sample = t0
    while True:
        now = time.monotonic()
        if proc.poll() is not None:
            sys.exit(f"the process ended with {proc.returncode} after {now - t0:.0f} s:\n{''.join(proc.log[-40:])}")
        if now >= next_sample:
            rss, fds = sample(proc.pid)
            points.append((now - t0, rss, fds))
            print(f"  {(now - t0) / 60:6.1f} min  RSS {rss:8.1f} MB  open files {fds:4d}", flush=True)
            next_sample += args.every
            if now - t0 >= args.minutes * 60:
                return points
        if on_tick:
            on_tick()
        time.sleep(1.0)


def verdict(points, args):
    half = [p for p in points if p[0] >= points[-1][0] / 2]
    warm = [p for p in points if p[0] < points[-1][0] / 2]
    rss_all = slope([(t, r) for t, r, _ in points])
    rss_half = slope([(t, r) for t, r, _ in half])
    fd_half = slope([(t, f) for t, _, f in half])
    (t0, r0, f0), (t1, r1, f1) = points[0], points[-1]
    print(f"RSS:        start {r0:.1f} MB, end {r1:.1f} MB, max {max(r for _, r, _ in points):.1f} MB; "
          f"slope {rss_all:+.2f} MB/h over the run, {rss_half:+.2f} MB/h over its second half")
    print(f"open files: start {f0}, end {f1}, max {max(f for _, _, f in points)}; "
          f"slope {fd_half:+.2f}/h over the second half")
    bad = []
    if rss_half > args.max_rss_slope:
        bad.append(f"RSS grows {rss_half:.2f} MB/h in the second half (limit {args.max_rss_slope})")
    # A sample can catch a client's connection or a checkpoint's file open: a few above the peak is not growth.
    if warm and f1 > max(f for _, _, f in warm) + args.fd_margin:
        bad.append(f"open files end at {f1}, more than {args.fd_margin} above the first half's peak {max(f for _, _, f in warm)}")
    return bad


def soak_serve(args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc, url = start([args.troupe, "serve", "--model", args.model, "--port", "0", "--max-batch", "16",
                       "--max-seq-len", "512"], env, "troupe serve: listening on ")
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    print(f"troupe serve {args.model}, one thread, 4 clients looping over {', '.join(Mix.KINDS)}; "
          f"sampled every {args.every:.0f} s for {args.minutes:g} min")
    stop = threading.Event()
    mix = Mix(port, stop, timeout=300)
    clients = [threading.Thread(target=mix.client, args=(i,)) for i in range(4)]
    try:
        for c in clients:
            c.start()
        points = watch(proc, args)
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=330)
    status, _ = get(port, "/health")
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    print(f"requests answered: {sum(mix.counts.values())} ({json.dumps(mix.counts)}); errors: {len(mix.errors)}")
    for e in mix.errors[:10]:
        print("  " + e)
    print(f"/health at the end: {status}; exit code after SIGTERM: {code}")
    bad = verdict(points, args)
    if mix.errors:
        bad.append(f"{len(mix.errors)} requests failed")
    if status != 200 or code != 0:
        bad.append("the server did not end healthy")
    return bad


def soak_grpo(args):
    run_dir = args.run_dir
    subprocess.run(["rm", "-rf", run_dir], check=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [args.troupe, "run", args.config, "trainer.steps=100000000", f"run.dir={run_dir}",
           f"run.checkpoint_every={args.checkpoint_every}", "run.dashboard=127.0.0.1:0", "trainer.threads=1"]
    proc, url = start(cmd, env, "dashboard at ")
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    print(f"troupe run {args.config}, one thread, a checkpoint every {args.checkpoint_every} steps, dashboard "
          f"polled once a second; sampled every {args.every:.0f} s for {args.minutes:g} min")
    polls = {"ok": 0, "failed": 0, "lines": 0, "why": []}

    def poll():  # as the page polls: only the lines it has not seen
        try:
            status, body = get(port, f"/api/run?name={os.path.basename(run_dir.rstrip('/'))}&from={polls['lines']}")
            polls["lines"] += len(json.loads(body)["metrics"]) if status == 200 else 0
            polls["ok" if status == 200 else "failed"] += 1
            if status != 200:
                polls["why"].append(f"HTTP {status}: {body[:200]!r}")
        except Exception as e:  # noqa: BLE001 - counted
            polls["failed"] += 1
            polls["why"].append(f"{type(e).__name__}: {e}")

    points = watch(proc, args, on_tick=poll)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f]
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    with open(os.path.join(run_dir, "status.json")) as f:
        state = json.load(f)["state"]
    first = sum(x["reward/mean"] for x in lines[:20]) / max(1, len(lines[:20]))
    last = sum(x["reward/mean"] for x in lines[-20:]) / max(1, len(lines[-20:]))
    print(f"steps: {len(lines)}; reward/mean over the first 20 {first:.3f}, over the last 20 {last:.3f}; "
          f"dashboard polls ok {polls['ok']} (read {polls['lines']} lines), failed {polls['failed']}; exit {code}, status.json: {state}")
    for why in polls["why"][:5]:
        print("  dashboard poll failed: " + why)
    bad = verdict(points, args)
    if polls["failed"]:
        bad.append(f"{polls['failed']} dashboard polls failed")
    if state != "stopped":
        bad.append(f"status.json says {state}, not stopped")
    return bad


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["serve", "grpo"])
    p.add_argument("--troupe", default="build/troupe")
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf", help="serve's model")
    p.add_argument("--config", default="configs/tiny_arithmetic_grpo.yaml", help="grpo's config")
    p.add_argument("--run-dir", default="runs/soak_grpo")
    p.add_argument("--checkpoint-every", type=int, default=1000)
    p.add_argument("--minutes", type=float, default=None, help="default: 30 for serve, 60 for grpo")
    p.add_argument("--every", type=float, default=60.0, help="seconds between samples")
    p.add_argument("--max-rss-slope", type=float, default=10.0, help="MB per hour allowed in the second half")
    p.add_argument("--fd-margin", type=int, default=4, help="open files allowed above the first half's peak (4 clients)")
    args = p.parse_args()
    if args.minutes is None:
        args.minutes = 30.0 if args.what == "serve" else 60.0
    bad = soak_serve(args) if args.what == "serve" else soak_grpo(args)
    for b in bad:
        print("FAIL: " + b)
    print("soak: " + ("FAILED" if bad else "flat: no unbounded growth"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
