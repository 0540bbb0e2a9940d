#!/usr/bin/env bash
# GSM8K in two stages for SmolLM2-135M-Instruct: SFT on the training solutions
# (configs/smollm2_gsm8k_sft.yaml), then async GRPO from SFT's last checkpoint
# (configs/smollm2_gsm8k_async_grpo.yaml), with the model evaluated before and after each stage on
# the first LIMIT GSM8K test problems: greedy pass@1, then 4 samples each at temperature 1
# (pass@1 over the samples, and pass@4). Prints the table with standard errors at the end.
#
#   scripts/gsm8k_two_stage.sh                            # the README's figures (hours on 2 cores)
#   SFT_STEPS=150 GRPO_STEPS=40 scripts/gsm8k_two_stage.sh   # shorter stages
#
# Everything goes to OUT (runs/gsm8k_two_stage). A stage already done is skipped and a training
# run that was stopped is resumed (resume=), so running the script again continues where it was.
# Change a setting and OUT's results no longer match it: use another OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

TROUPE=${TROUPE:-build/troupe}
OUT=${OUT:-runs/gsm8k_two_stage}
LIMIT=${LIMIT:-500}           # test problems per evaluation (the first LIMIT of test.jsonl)
SAMPLES=${SAMPLES:-4}         # samples per problem at temperature 1 (pass@1 over them, pass@SAMPLES)
MAX_TOKENS=${MAX_TOKENS:-256} # completion budget of the evaluations, as the GRPO config's
BATCH=${BATCH:-64}            # sequences the evaluations decode together
SFT_STEPS=${SFT_STEPS:-450}   # the SFT config's own: about one epoch
GRPO_STEPS=${GRPO_STEPS:-200} # the GRPO config's own
SFT_ARGS=${SFT_ARGS:-}        # more key=value overrides of each stage's config, space-separated
GRPO_ARGS=${GRPO_ARGS:-}
BASE=${BASE:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
TEST=../shared/data/gsm8k/test.jsonl
SFT_CONFIG=configs/smollm2_gsm8k_sft.yaml
GRPO_CONFIG=configs/smollm2_gsm8k_async_grpo.yaml
# The prompt both configs train with (their data.train.system), so evaluation asks as training did.
SYSTEM=$(sed -n 's/^ *system: "\(.*\)".*/\1/p' "$GRPO_CONFIG" | head -1)

say() { printf 'gsm8k_two_stage: %s\n' "$*"; }
for f in "$TROUPE" "$BASE" "$TEST"; do
  [ -e "$f" ] || { echo "gsm8k_two_stage: $f does not exist (make build and make setup make it)" >&2; exit 1; }
done
mkdir -p "$OUT"

# model, name -> OUT/eval_NAME.txt: the greedy result line, then the sampled one.
evaluate() {
  local file=$OUT/eval_$2.txt
  if [ -s "$file" ]; then say "evaluation '$2' done before: $file"; return; fi
  say "evaluating '$2' ($1) on $LIMIT test problems"
  local common=(eval gsm8k --model "$1" --data "$TEST" --limit "$LIMIT" --max-tokens "$MAX_TOKENS" --batch "$BATCH"
                --system "$SYSTEM" --dtype auto --seed 0)
  "$TROUPE" "${common[@]}" | tail -1 > "$file.part"
  "$TROUPE" "${common[@]}" --samples "$SAMPLES" --temperature 1.0 | tail -1 >> "$file.part"
  mv "$file.part" "$file"
  cat "$file"
}

# run dir -> its checkpoint of the highest step (empty when none)
last_checkpoint() { ls -d "$1"/checkpoints/step_* 2>/dev/null | sort -V | tail -1; }

# config, run dir, steps, overrides... -> the run trained to `steps` (resumed where it stopped)
train() {
  local config=$1 dir=$2 steps=$3
  shift 3
  if [ -d "$dir/checkpoints/step_$steps" ]; then say "$dir done before"; return; fi
  local args=("$config" "run.dir=$dir" "trainer.steps=$steps" "$@")
  if [ -n "$(last_checkpoint "$dir")" ]; then
    say "resuming $dir from $(last_checkpoint "$dir")"
    args+=("resume=$dir")
  else
    rm -rf "$dir"
  fi
  "$TROUPE" run "${args[@]}"
  [ -d "$dir/checkpoints/step_$steps" ] || { echo "gsm8k_two_stage: $dir has no checkpoint of step $steps" >&2; exit 1; }
}

evaluate "$BASE" base
# shellcheck disable=SC2086  # the overrides are words
train "$SFT_CONFIG" "$OUT/sft" "$SFT_STEPS" $SFT_ARGS
SFT_MODEL=$(last_checkpoint "$OUT/sft")
evaluate "$SFT_MODEL" sft
# shellcheck disable=SC2086
train "$GRPO_CONFIG" "$OUT/grpo" "$GRPO_STEPS" "model.path=$SFT_MODEL" $GRPO_ARGS
evaluate "$(last_checkpoint "$OUT/grpo")" grpo

# The table: each figure with its standard error over the problems, sqrt(p (1 - p) / n), and the
# change of each stage in standard errors of the difference (the same problems, but treated as
# independent: a conservative bound).
python3 - "$OUT" "$SAMPLES" <<'EOF'
import math, re, sys
out, k = sys.argv[1], sys.argv[2]
def read(name):
    lines = open(f"{out}/eval_{name}.txt").read().splitlines()
    get = lambda line, key: float(re.search(rf"\b{re.escape(key)}=([0-9.]+)", line).group(1))
    n = int(get(lines[0], "n"))
    return n, [get(lines[0], "pass@1"), get(lines[1], "pass@1"), get(lines[1], f"pass@{k}")]
stages = [("SmolLM2-135M-Instruct", "base"), ("after SFT", "sft"), ("after SFT + GRPO", "grpo")]
rows = {name: read(name) for _, name in stages}
n = rows["base"][0]
se = lambda p, n: math.sqrt(p * (1 - p) / n)
cols = ["greedy pass@1", f"pass@1, T=1 ({k} samples)", f"pass@{k}, T=1"]
print(f"\nGSM8K test, first {n} problems; each figure +- its standard error")
print(f"{'model':24}" + "".join(f"{c:>28}" for c in cols))
for label, name in stages:
    m, ps = rows[name]
    print(f"{label:24}" + "".join(f"{100 * p:21.1f} +- {100 * se(p, m):3.1f}" for p in ps))
for (_, a), (_, b), label in zip(stages, stages[1:], ["change by SFT", "change by GRPO"]):
    deltas = []
    for pa, pb in zip(rows[a][1], rows[b][1]):
        d, s = pb - pa, math.sqrt(se(pa, n) ** 2 + se(pb, n) ** 2)
        deltas.append(f"{100 * d:+15.1f} ({d / s:+.1f} SE)" if s > 0 else f"{100 * d:+15.1f}")
    print(f"{label:24}" + "".join(f"{x:>28}" for x in deltas))
EOF
