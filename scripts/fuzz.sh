#!/usr/bin/env bash
# Builds the libFuzzer harnesses (tests/fuzz/, clang with ASan and UBSan, into build/fuzz), makes
# their seed corpora from the test fixtures, and runs each harness for a while: first its
# reproducers in tests/fuzz/regressions/<harness>/, then fuzzing for FUZZ_SECONDS.
#
#   scripts/fuzz.sh [--seconds N] [--runs N] [--compile-only | --build-only | --no-build] [HARNESS ...]   (default: every harness)
#
# --compile-only compiles the harnesses and stops (make build does this); --build-only also makes the seeds.
# --runs stops a harness after N executions (libFuzzer's -runs), --seconds in any case.
# `make fuzz` runs it for 600 s a harness; each ctest test fuzz_<harness> for a few seconds. New
# inputs that add coverage are kept in build/fuzz/corpus/<harness>/, so long runs build on each
# other. A crash, hang, leak, out-of-memory or sanitizer report fails the run and prints the saved
# input, the command that reproduces it and the one that minimises it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

FUZZ_BUILD=${FUZZ_BUILD:-$ROOT/build/fuzz}
FUZZ_FIXTURES=${FUZZ_FIXTURES:-$ROOT/build/fixtures}
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
FUZZ_RUNS=${FUZZ_RUNS:--1}           # executions per harness; -1: until FUZZ_SECONDS
FUZZ_CXX=${FUZZ_CXX:-clang++-14}
FUZZ_JOBS=${FUZZ_JOBS:-$(nproc)}
FUZZ_MAX_LEN=${FUZZ_MAX_LEN:-65536}
FUZZ_TIMEOUT=${FUZZ_TIMEOUT:-10}      # seconds one input may take before it counts as a hang
FUZZ_RSS_MB=${FUZZ_RSS_MB:-2048}      # memory one harness may use (libFuzzer's -rss_limit_mb)

build=1 run=1 seeds=1
harnesses=()
while (($#)); do
  case "$1" in
    --seconds) FUZZ_SECONDS=$2; shift 2 ;;
    --runs) FUZZ_RUNS=$2; shift 2 ;;
    --compile-only) run=0 seeds=0; shift ;;
    --build-only) run=0; shift ;;
    --no-build) build=0; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) harnesses+=("$1"); shift ;;
  esac
done
all=$(sed -n '/^set(TROUPE_FUZZ_HARNESSES/,/)/p' tests/fuzz/harnesses.cmake | sed 's/set(TROUPE_FUZZ_HARNESSES//; s/)//')
((${#harnesses[@]})) || read -r -a harnesses <<< "$(echo $all)"
for h in "${harnesses[@]}"; do
  [[ " $(echo $all) " == *" $h "* ]] || { echo "fuzz.sh: no harness '$h' (harnesses: $(echo $all))" >&2; exit 2; }
done

if ((build)); then
  command -v "$FUZZ_CXX" >/dev/null || { echo "fuzz.sh: $FUZZ_CXX not found (scripts/setup.sh installs clang-14)" >&2; exit 1; }
  if [ ! -f "$FUZZ_BUILD/CMakeCache.txt" ]; then
    cmake -S tests/fuzz -B "$FUZZ_BUILD" -DCMAKE_CXX_COMPILER="$FUZZ_CXX" >/dev/null
  fi
  if ! nice -n 10 cmake --build "$FUZZ_BUILD" -j "$FUZZ_JOBS" > "$FUZZ_BUILD/build.log" 2>&1; then
    tail -40 "$FUZZ_BUILD/build.log" >&2
    echo "fuzz.sh: the harnesses do not build (log: $FUZZ_BUILD/build.log)" >&2
    exit 1
  fi
  ((seeds)) || exit 0
  [ -d "$FUZZ_FIXTURES" ] || echo "fuzz.sh: no $FUZZ_FIXTURES (run make test once): seeds from configs/ and data/ only" >&2
  rm -rf "$FUZZ_BUILD/seeds"
  python3 tests/fuzz/make_seeds.py "$FUZZ_FIXTURES" "$FUZZ_BUILD/seeds"
fi
((run)) || exit 0
[ -d "$FUZZ_BUILD/seeds" ] || { echo "fuzz.sh: no seeds in $FUZZ_BUILD/seeds: run it without --no-build first" >&2; exit 1; }

stat() { sed -n "s/^stat::$1: *//p" "$2" | tail -1; }
failed=()
for h in "${harnesses[@]}"; do
  bin=$FUZZ_BUILD/fuzz_$h
  log=$FUZZ_BUILD/logs/$h.log
  artifacts=$FUZZ_BUILD/artifacts/$h
  mkdir -p "$FUZZ_BUILD/corpus/$h" "$FUZZ_BUILD/logs" "$artifacts"
  [ -x "$bin" ] || { echo "fuzz $h: $bin is not built" >&2; failed+=("$h"); continue; }
  flags=(-timeout="$FUZZ_TIMEOUT" -rss_limit_mb="$FUZZ_RSS_MB" -max_len="$FUZZ_MAX_LEN" -artifact_prefix="$artifacts/")
  [ -f "$FUZZ_BUILD/seeds/$h.dict" ] && flags+=(-dict="$FUZZ_BUILD/seeds/$h.dict")

  status=0
  regressions=$ROOT/tests/fuzz/regressions/$h
  if [ -d "$regressions" ] && [ -n "$(ls -A "$regressions")" ]; then
    # Each reproducer on its own: a file given by name is run once, and any failure is reported.
    timeout -k 10 300 "$bin" "${flags[@]}" "$regressions"/* > "$log.regressions" 2>&1 || status=$?
    if ((status)); then
      echo "fuzz $h: a reproducer in tests/fuzz/regressions/$h/ fails again (exit $status):" >&2
      grep -E "^Running: |ERROR|SUMMARY|fuzz harness|what\(\)|runtime error" "$log.regressions" | tail -20 | cut -c1-300 >&2
      echo "  full log: $log.regressions" >&2
      failed+=("$h")
      continue
    fi
  fi

  start=$(date +%s)
  timeout -k 10 $((FUZZ_SECONDS + 120)) "$bin" "${flags[@]}" -max_total_time="$FUZZ_SECONDS" -runs="$FUZZ_RUNS" -print_final_stats=1 \
    "$FUZZ_BUILD/corpus/$h" "$FUZZ_BUILD/seeds/$h" > "$log" 2>&1 || status=$?
  secs=$(($(date +%s) - start))
  execs=$(stat number_of_executed_units "$log"); rate=$(stat average_exec_per_sec "$log")
  corpus=$(ls "$FUZZ_BUILD/corpus/$h" | wc -l)
  if ((status)); then
    failed+=("$h")
    echo "fuzz $h: FAILED after ${secs} s (exit $status$( ((status == 124)) && echo ': the run itself hung past its time limit')):" >&2
    grep -E "ERROR|SUMMARY|fuzz harness|what\(\)|runtime error|Test unit written" "$log" | head -20 | cut -c1-300 >&2
    # The top of the first stack trace: where it went wrong.
    awk '/ERROR|runtime error|deadly signal/ {on = 1} on && /^    #[0-9]+ / {print; if (++n == 12) exit}' "$log" | cut -c1-300 >&2
    for a in $(grep -o "Test unit written to [^ ]*" "$log" | sed 's/Test unit written to //'); do
      echo "  reproducer:  $a" >&2
      echo "  reproduce:   $bin $a" >&2
      echo "  minimise:    $bin -minimize_crash=1 -runs=20000 -artifact_prefix=$artifacts/min- $a" >&2
      echo "  then keep it: cp <minimised> tests/fuzz/regressions/$h/<what-it-is>, fix the parser, add a doctest" >&2
    done
    echo "  full log: $log" >&2
  else
    printf 'fuzz %-17s %9s executions in %4d s (%6s/s), corpus %5d inputs, 0 crashes\n' "$h" "${execs:-?}" "$secs" "${rate:-?}" "$corpus"
  fi
done
if ((${#failed[@]})); then
  echo "fuzz.sh: failed: ${failed[*]}" >&2
  exit 1
fi
