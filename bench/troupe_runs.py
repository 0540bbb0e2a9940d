"""What the benchmarks that drive `troupe run` share: one run, its wall time and its metrics."""
import json
import os
import subprocess
import sys
import time


def run_troupe(troupe, config, args, run_dir):
    """`troupe run CONFIG ARGS run.dir=RUN_DIR`; exits with its output when it fails. Returns
    (every step's metrics from metrics.jsonl, the process's wall time in seconds)."""
    cmd = [troupe, "run", config] + list(args) + [f"run.dir={run_dir}"]
    start = time.time()
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.time() - start
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], wall
