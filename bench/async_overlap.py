"""Async against synchronous GRPO: wall time of N steps with max_staleness 1 against 0.

python bench/async_overlap.py --troupe build/troupe [--config configs/demo.yaml] [--steps 20]

Runs `troupe run` on the same config and seed with async.max_staleness=1 and =0, one after the
other in this process, and prints both wall times and the ratio. The time of a run is the sum of
the trainer's time/step_s and time/generate_wait_s over its steps: from the trainer being ready
to its last step, so model loading is left out on both sides.

On a CPU both phases compete for the same cores. With --split the generator and the trainer
each get half of them (generator.threads, trainer.threads), which is the setting in which
overlap can pay; the synchronous run is also measured with every core per phase (its best
setting) so the comparison is honest.
"""
import argparse
import os
import tempfile

from troupe_runs import run_troupe


def run(troupe, config, steps, eta, overrides, workdir, tag):
    metrics, wall = run_troupe(troupe, config, [f"trainer.steps={steps}", f"async.max_staleness={eta}"] + overrides,
                               os.path.join(workdir, tag))
    train = sum(m["time/step_s"] for m in metrics)
    wait = sum(m["time/generate_wait_s"] for m in metrics)
    return {"tag": tag, "eta": eta, "steps": len(metrics), "time": train + wait, "train": train, "wait": wait,
            "process": wall, "reward": [round(m["reward/mean"], 3) for m in metrics]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--troupe", default="build/troupe")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="cores to split between the two phases")
    p.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for both runs")
    args = p.parse_args()
    half = max(1, args.threads // 2)
    split = [f"generator.threads={half}", f"trainer.threads={max(1, args.threads - half)}"]
    shared = list(args.set)
    print(f"config {args.config}, {args.steps} steps, seed from the config; {args.threads} cores; "
          f"split = {half} generator + {max(1, args.threads - half)} trainer threads")
    with tempfile.TemporaryDirectory(prefix="troupe_bench_async_") as work:
        results = [
            run(args.troupe, args.config, args.steps, 1, shared + split, work, "eta1_split"),
            run(args.troupe, args.config, args.steps, 0, shared + split, work, "eta0_split"),
            run(args.troupe, args.config, args.steps, 0, shared, work, "eta0_all_cores"),
        ]
    for r in results:
        print(f"{r['tag']:>15}: {r['steps']} steps in {r['time']:7.1f} s (train {r['train']:6.1f} s, "
              f"waiting for rollouts {r['wait']:6.1f} s; process {r['process']:6.1f} s)")
    a, s, best = results
    print(f"speedup eta=1 over eta=0, same split:       {s['time']:.1f} / {a['time']:.1f} = {s['time'] / a['time']:.2f}x")
    print(f"speedup eta=1 (split) over eta=0 all cores: {best['time']:.1f} / {a['time']:.1f} = {best['time'] / a['time']:.2f}x")
    for r in results:
        print(f"{r['tag']:>15} reward/mean per step: {r['reward']}")


if __name__ == "__main__":
    main()
