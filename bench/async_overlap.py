"""Async against synchronous GRPO: wall time of N steps with max_staleness 1 against 0, on the same tokens.

python bench/async_overlap.py --troupe build/troupe [--config configs/demo.yaml] [--steps 20]

Runs `troupe run` on the same config and seed three times, one after the other in this process:
  sync_all_cores  async.max_staleness=0, every core for each phase in turn: the baseline;
  async_split     async.max_staleness=1, the cores split between generator and trainer
                  (generator.threads, trainer.threads), the setting in which overlap can pay;
  sync_split      async.max_staleness=0 on the same split: what the overlap alone buys.
The headline is async_split against sync_all_cores, the synchronous run in its best setting.

EOS is ignored (generator.ignore_eos=true), so every completion runs to generator.max_tokens and
the runs generate the same number of tokens whatever their weights sample; without it a run whose
policy learns shorter answers would look faster. Each run's total (completion_tokens in
metrics.jsonl, summed over steps) is printed, and the script exits 1 if they differ.

The time of a run is the sum of the trainer's time/step_s and time/generate_wait_s over its steps:
from the trainer being ready to its last step, so model loading is left out on every run.
"""
import argparse
import os
import sys
import tempfile

from troupe_runs import run_troupe


def run(troupe, config, steps, eta, overrides, workdir, tag):
    metrics, wall = run_troupe(troupe, config, [f"trainer.steps={steps}", f"async.max_staleness={eta}",
                                                "generator.ignore_eos=true"] + overrides,
                               os.path.join(workdir, tag))
    train = sum(m["time/step_s"] for m in metrics)
    wait = sum(m["time/generate_wait_s"] for m in metrics)
    return {"tag": tag, "steps": len(metrics), "time": train + wait, "train": train, "wait": wait, "process": wall,
            "tokens": sum(m["completion_tokens"] for m in metrics),
            "reward": [round(m["reward/mean"], 3) for m in metrics]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--troupe", default="build/troupe")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="cores to split between the two phases")
    p.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every run")
    args = p.parse_args()
    half = max(1, args.threads // 2)
    split = [f"generator.threads={half}", f"trainer.threads={max(1, args.threads - half)}"]
    all_cores = [f"generator.threads={args.threads}", f"trainer.threads={args.threads}"]
    shared = list(args.set)
    print(f"config {args.config}, {args.steps} steps, seed from the config, EOS ignored; {args.threads} cores; "
          f"split = {half} generator + {max(1, args.threads - half)} trainer threads")
    with tempfile.TemporaryDirectory(prefix="troupe_bench_async_") as work:
        base, fast, same = (run(args.troupe, args.config, args.steps, 0, shared + all_cores, work, "sync_all_cores"),
                            run(args.troupe, args.config, args.steps, 1, shared + split, work, "async_split"),
                            run(args.troupe, args.config, args.steps, 0, shared + split, work, "sync_split"))
    results = (base, fast, same)
    print(f"speedup async_split over sync_all_cores (headline): {base['time']:.1f} / {fast['time']:.1f} s = "
          f"{base['time'] / fast['time']:.2f}x")
    print(f"speedup async_split over sync_split (same cores):   {same['time']:.1f} / {fast['time']:.1f} s = "
          f"{same['time'] / fast['time']:.2f}x")
    for r in results:
        print(f"{r['tag']:>15}: {r['steps']} steps, {r['tokens']} completion tokens in {r['time']:7.1f} s "
              f"({r['tokens'] / r['time']:6.1f} tokens/s; train {r['train']:6.1f} s, waiting for rollouts "
              f"{r['wait']:6.1f} s; process {r['process']:6.1f} s)")
    for r in results:
        print(f"{r['tag']:>15} reward/mean per step: {r['reward']}")
    if len({r["tokens"] for r in results}) != 1 or len({r["steps"] for r in results}) != 1:
        sys.exit("the runs did not generate the same tokens: the times above do not compare like for like")


if __name__ == "__main__":
    main()
