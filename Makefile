# The two commands of the README: `make demo` and `make test`. Both set up what is
# missing (scripts/setup.sh is idempotent), build with CMake, then run.
SHELL := /bin/bash
BUILD ?= build
JOBS ?= 2
PY := .venv/bin/python
MODEL := models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: all setup configure build test test-sanitize demo bench fuzz clean

all: build

setup:
	@scripts/setup.sh

$(BUILD)/CMakeCache.txt: CMakeLists.txt | setup
	@torch_root=$$($(PY) -c 'import os, torch; print(os.path.dirname(torch.__file__))') && \
	 torch_cuda=$$($(PY) -c 'import torch; print(torch.version.cuda or "")') && \
	 cmake -S . -B $(BUILD) -DTROUPE_TORCH_ROOT=$$torch_root -DTROUPE_TORCH_CUDA_VERSION=$$torch_cuda \
	       -DTROUPE_PYTHON=$(CURDIR)/$(PY) $(CMAKE_ARGS)

configure: $(BUILD)/CMakeCache.txt

build: setup configure
	@cmake --build $(BUILD) -j $(JOBS)

# Two tests at a time, one per core (tests/CMakeLists.txt says which run alone).
test: build
	@cd $(BUILD) && ctest --output-on-failure --no-tests=error -j 2

# The whole suite again, every troupe target built with AddressSanitizer and UndefinedBehavior-
# Sanitizer in its own folder (a cold build: it compiles everything once more). The fuzz harnesses
# have their own sanitizer build (make fuzz), so they are left out here. Options and suppressions,
# each with its reason: tests/sanitize/. Not part of `make test` (see the README for its time).
# Every process's report goes to a file in SANITIZE_REPORTS, so that one from a process a test
# started and did not check (a worker, a server) fails the target too, after the suite has run.
SANITIZE_BUILD ?= build-sanitize
SANITIZE_REPORTS := $(CURDIR)/$(SANITIZE_BUILD)/sanitizer-reports
SANITIZE_ENV := ASAN_OPTIONS="$$(paste -sd: tests/sanitize/asan.options):log_path=$(SANITIZE_REPORTS)/report:log_exe_name=1" \
                LSAN_OPTIONS=suppressions=$(CURDIR)/tests/sanitize/lsan.supp:print_suppressions=0 \
                UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:suppressions=$(CURDIR)/tests/sanitize/ubsan.supp:log_path=$(SANITIZE_REPORTS)/report:log_exe_name=1
test-sanitize: setup
	@$(MAKE) --no-print-directory BUILD=$(SANITIZE_BUILD) CMAKE_ARGS=-DTROUPE_SANITIZE=address,undefined build
	@rm -rf $(SANITIZE_REPORTS) && mkdir -p $(SANITIZE_REPORTS)
	@cd $(SANITIZE_BUILD) && $(SANITIZE_ENV) ctest --output-on-failure --no-tests=error -j 2 -E '^fuzz_'; status=$$?; \
	  reports=$$(ls $(SANITIZE_REPORTS)); \
	  for f in $$reports; do echo "== sanitizer report $(SANITIZE_REPORTS)/$$f"; cat $(SANITIZE_REPORTS)/$$f; done; \
	  if [ -n "$$reports" ]; then echo "make test-sanitize: $$(echo $$reports | wc -w) sanitizer reports (above)"; exit 1; fi; \
	  exit $$status

# A short async GRPO run of SmolLM2-135M-Instruct on generated arithmetic word problems
# (configs/demo.yaml says why), reward printed per step, then the held-out split before (the base
# model; cached per dtype) and after (the run's last checkpoint) as a table: greedy pass@1, and
# pass@1 over 4 samples at the training temperature 0.7 (the policy GRPO trains is that sampler).
# It starts afresh in runs/demo. DEMO_DTYPE: auto (default: bfloat16 where the CPU computes it
# natively, else float32), float32 or bfloat16; DEMO_ARGS: more overrides for troupe run, e.g.
# `make demo DEMO_ARGS=trainer.steps=5`.
DEMO_DTYPE ?= auto
DEMO_ARGS ?=
DEMO_DIR := runs/demo
DEMO_TEST := data/arithmetic_test.jsonl
# The dtype DEMO_DTYPE computes in on this machine (auto resolved, as troupe validate reports it),
# so the base model's cached evaluation is one of the dtype the run trains in. Recursive: expanded
# only when the demo's recipe runs, after the build.
DEMO_RESOLVED = $(shell $(BUILD)/troupe validate configs/demo.yaml model.dtype=$(DEMO_DTYPE) | sed -n 's/^model.dtype: //p')
DEMO_BEFORE = runs/demo_eval_before.$(DEMO_RESOLVED).txt
# Same prompt as training: data.train.system and generator.max_tokens of configs/demo.yaml.
DEMO_EVAL = $(BUILD)/troupe eval gsm8k --data $(DEMO_TEST) --max-tokens 32 --batch 50 --dtype $(DEMO_RESOLVED) \
            --system "$$(sed -n 's/^ *system: "\(.*\)".*/\1/p' configs/demo.yaml | head -1)"
DEMO_SAMPLED := --samples 4 --temperature 0.7 --seed 0
# Both evaluations of one model, one result line each: greedy, then sampled.
DEMO_EVAL_BOTH = set -o pipefail; $(DEMO_EVAL) --model $(1) | tail -1 > $(2).part && \
                 $(DEMO_EVAL) $(DEMO_SAMPLED) --model $(1) | tail -1 >> $(2).part && mv $(2).part $(2)

runs/demo_eval_before.%.txt: configs/demo.yaml scripts/make_arithmetic_words.py | build
	@mkdir -p $(@D)
	$(call DEMO_EVAL_BOTH,$(MODEL),$@)

demo: build
	@[ -n "$(DEMO_RESOLVED)" ] || $(BUILD)/troupe validate configs/demo.yaml model.dtype=$(DEMO_DTYPE)
	@$(MAKE) --no-print-directory $(DEMO_BEFORE)
	rm -rf $(DEMO_DIR)
	$(BUILD)/troupe run configs/demo.yaml model.dtype=$(DEMO_DTYPE) $(DEMO_ARGS)
	$(call DEMO_EVAL_BOTH,$$(ls -d $(DEMO_DIR)/checkpoints/step_* | sort -V | tail -1),$(DEMO_DIR)/eval_after.txt)
	@p() { sed -n "$$1s/.*pass@1=\([0-9.]*\).*/\1/p" $$2; }; \
	 awk -v s=$(DEMO_TEST) -v n="$$(sed -n '1s/.* n=\([0-9]*\) .*/\1/p' $(DEMO_BEFORE))" \
	     -v b1=$$(p 1 $(DEMO_BEFORE)) -v a1=$$(p 1 $(DEMO_DIR)/eval_after.txt) \
	     -v b2=$$(p 2 $(DEMO_BEFORE)) -v a2=$$(p 2 $(DEMO_DIR)/eval_after.txt) 'BEGIN { \
	   printf "\nheld-out split: %s, %d problems\n%-36s %13s %8s %8s\n", s, n, "decoding", "pass@1 before", "after", "change"; \
	   printf "%-36s %12.1f%% %7.1f%% %+8.1f\n", "greedy", 100*b1, 100*a1, 100*(a1-b1); \
	   printf "%-36s %12.1f%% %7.1f%% %+8.1f\n", "4 samples each at temperature 0.7", 100*b2, 100*a2, 100*(a2-b2) }'

# Each benchmark runs troupe and its peer in one process and prints both sides and the ratio.
# async_overlap runs one prompt x G=6 completions of 192 tokens (EOS ignored) per step, so decoding
# (latency-bound on a CPU) and training take similar time, as its goal asks; its peer is troupe
# itself, synchronous on every core.
bench: build
	$(PY) bench/forward_throughput.py --troupe $(BUILD)/troupe --bench $(BUILD)/bench/bench_forward --model $(MODEL) --work $(BUILD)/bench_models/smollm2
	$(PY) bench/generation_throughput.py --troupe $(BUILD)/troupe --bench $(BUILD)/bench/bench_generate --model $(MODEL) --work $(BUILD)/bench_models/smollm2
	$(PY) bench/decode_llamacpp.py --bench $(BUILD)/bench/bench_decode --model $(MODEL)
	$(PY) bench/decode_llamacpp.py --bench $(BUILD)/bench/bench_decode --model $(MODEL) --weights int8
	$(PY) bench/decode_llamacpp.py --bench $(BUILD)/bench/bench_decode --model $(MODEL) --weights int4
	$(BUILD)/bench/bench_prefix --model $(MODEL) --prompt-tokens 512 --n 8
	$(PY) bench/serve_load.py --troupe $(BUILD)/troupe --model $(MODEL)
	$(PY) bench/sft_throughput.py --troupe $(BUILD)/troupe --bench $(BUILD)/bench/bench_sft --model $(MODEL) --work $(BUILD)/bench_models/smollm2
	$(PY) bench/sft_parallel.py --troupe $(BUILD)/troupe --bench $(BUILD)/bench/bench_sft --model $(MODEL) --work $(BUILD)/bench_models/smollm2 --sharding zero2
	$(PY) bench/sft_parallel.py --troupe $(BUILD)/troupe --bench $(BUILD)/bench/bench_sft --model $(MODEL) --work $(BUILD)/bench_models/smollm2 --sharding zero3
	$(PY) bench/cluster_processes.py --troupe $(BUILD)/troupe --config configs/tiny_arithmetic_grpo.yaml --steps 60
	$(PY) bench/async_overlap.py --troupe $(BUILD)/troupe --config configs/demo.yaml --steps 20 --set trainer.batch_groups=1 generator.group_size=6 generator.max_tokens=192 generator.max_seq_len=256
	$(PY) bench/memory.py --troupe $(BUILD)/troupe --config configs/demo.yaml --dtype float32 --steps 4

# Every parser's libFuzzer harness (tests/fuzz/: clang with ASan and UBSan, built in $(BUILD)/fuzz)
# for FUZZ_RUNS executions each, or FUZZ_SECONDS where the parser is slower, seeded from the test
# fixtures (made first) after replaying its reproducers in tests/fuzz/regressions/. `make test`
# runs each for 5 s; scripts/fuzz.sh HARNESS runs one.
FUZZ_RUNS ?= 1000000
FUZZ_SECONDS ?= 1800
fuzz: configure
	@cd $(BUILD) && ctest --output-on-failure -R '^fixture_(safetensors|gguf|tokenizer|sft|hf_models|arithmetic)$$'
	FUZZ_BUILD=$(abspath $(BUILD))/fuzz FUZZ_FIXTURES=$(abspath $(BUILD))/fixtures FUZZ_SECONDS=$(FUZZ_SECONDS) \
	  FUZZ_RUNS=$(FUZZ_RUNS) scripts/fuzz.sh

clean:
	rm -rf $(BUILD)
