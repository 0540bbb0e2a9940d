"""Generators in worker processes against generators in the run's own process.

python bench/cluster_processes.py --troupe build/troupe [--config configs/tiny_arithmetic_grpo.yaml]
       [--steps 40] [--generators 2] [--threads 1] [--transport auto|http] [--extra key=value ...]

Runs `troupe run` twice on the same config, seed and cores, one after the other in this process:
with generator.count=N (N generators in-process) and with cluster.generator_processes=N (N
`troupe worker` processes joined over CAF's network layer on loopback, weights through the
shared-memory data plane). Every generator and the trainer get --threads threads. Prints both
wall times (the trainer's time/step_s + time/generate_wait_s over the steps, so model loading and
process start are left out on both sides; the whole process time is printed too), the ratio, and
the weight sync figures of the worker run: bytes per sync, the trainer's write time, the slowest
generator's load time, effective GB/s, beside a plain memcpy of the same bytes in this process.
Goal: the process boundary costs under 10% (ratio <= 1.1).
"""
import argparse
import os
import tempfile
import time

from troupe_runs import run_troupe


def run(troupe, config, steps, overrides, workdir, tag):
    metrics, wall = run_troupe(troupe, config, [f"trainer.steps={steps}"] + overrides, os.path.join(workdir, tag))
    busy = sum(m["time/step_s"] + m["time/generate_wait_s"] for m in metrics)
    syncs = [m for m in metrics if "weights/bytes" in m]
    return {"tag": tag, "time": busy, "process": wall, "metrics": metrics, "syncs": syncs}


def memcpy_seconds(nbytes):
    """Plain copies of nbytes in this process, best of 3 each: into a fresh buffer (its pages
    are touched for the first time, as the trainer's file in shared memory is) and into one
    already touched (one memcpy at memory speed)."""
    src = bytearray(os.urandom(nbytes))
    fresh = touched = float("inf")
    dst = bytearray(nbytes)
    for _ in range(3):
        t = time.perf_counter()
        copy = bytes(src)
        fresh = min(fresh, time.perf_counter() - t)
        del copy
        t = time.perf_counter()
        dst[:] = src
        touched = min(touched, time.perf_counter() - t)
    return fresh, touched


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--troupe", required=True)
    p.add_argument("--config", default="configs/tiny_arithmetic_grpo.yaml")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--generators", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--extra", nargs="*", default=[], help="more key=value overrides for both runs")
    p.add_argument("--workers-only", action="store_true",
                   help="skip the in-process run: only the weight sync figures (e.g. for a slow bf16 model)")
    p.add_argument("--transport", default="auto", choices=["auto", "http"],
                   help="how the workers take weights: auto (shared memory on this host) or http (from the trainer)")
    a = p.parse_args()
    common = [f"generator.threads={a.threads}", f"trainer.threads={a.threads}", "run.deterministic=true"] + a.extra
    with tempfile.TemporaryDirectory() as work:
        inproc = None if a.workers_only else run(a.troupe, a.config, a.steps, common + [f"generator.count={a.generators}"],
                                                 work, "in_process")
        workers = run(a.troupe, a.config, a.steps, common + [f"cluster.generator_processes={a.generators}",
                                                         f"cluster.weight_transport={a.transport}"], work, "workers")
    print(f"config {a.config}, {a.steps} steps, {a.generators} generators, {a.threads} thread(s) each, deterministic, "
          f"weights to workers: {a.transport}")
    if inproc is not None:
        strip = lambda m: {k: v for k, v in m.items() if not k.startswith(("time/", "generators/")) and k != "tokens_per_s"}
        same = all(strip(x) == strip(y) for x, y in zip(inproc["metrics"], workers["metrics"]))
        print(f"  in-process generators : {inproc['time']:8.2f} s  (process {inproc['process']:.2f} s)")
    print(f"  worker processes      : {workers['time']:8.2f} s  (process {workers['process']:.2f} s)")
    if inproc is not None:
        print(f"  ratio workers / in-process: {workers['time'] / inproc['time']:.3f}  (goal <= 1.1)")
        print(f"  metrics other than timings identical: {same}")
    if workers["syncs"]:
        nbytes = workers["syncs"][0]["weights/bytes"]
        write = sum(m["time/weights_write_s"] for m in workers["syncs"]) / len(workers["syncs"])
        loads = [m["time/weights_load_s"] for m in workers["metrics"] if m["time/weights_load_s"] > 0]
        load = sum(loads) / max(1, len(loads))
        fresh, touched = memcpy_seconds(nbytes)
        print(f"  weight sync: {nbytes / 1e6:.2f} MB per version; trainer write {write * 1e3:.2f} ms "
              f"({nbytes / max(write, 1e-12) / 1e9:.2f} GB/s), slowest generator load {load * 1e3:.2f} ms "
              f"({nbytes / max(load, 1e-12) / 1e9:.2f} GB/s)")
        print(f"  memcpy of the same {nbytes / 1e6:.2f} MB here: {fresh * 1e3:.2f} ms into fresh pages "
              f"({nbytes / fresh / 1e9:.2f} GB/s), {touched * 1e3:.2f} ms into touched ones ({nbytes / touched / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
