# The two commands of the README: `make demo` and `make test`. Both set up what is
# missing (scripts/setup.sh is idempotent), build with CMake, then run.
SHELL := /bin/bash
BUILD ?= build
JOBS ?= 2
PY := .venv/bin/python
MODEL := models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: all setup configure build test demo bench clean

all: build

setup:
	@scripts/setup.sh

$(BUILD)/CMakeCache.txt: CMakeLists.txt | setup
	@torch_root=$$($(PY) -c 'import os, torch; print(os.path.dirname(torch.__file__))') && \
	 torch_cuda=$$($(PY) -c 'import torch; print(torch.version.cuda or "")') && \
	 cmake -S . -B $(BUILD) -DTROUPE_TORCH_ROOT=$$torch_root -DTROUPE_TORCH_CUDA_VERSION=$$torch_cuda \
	       -DTROUPE_PYTHON=$(CURDIR)/$(PY)

configure: $(BUILD)/CMakeCache.txt

build: setup configure
	@cmake --build $(BUILD) -j $(JOBS)

# Two tests at a time, one per core (tests/CMakeLists.txt says which run alone).
test: build
	@cd $(BUILD) && ctest --output-on-failure --no-tests=error -j 2

# A short async GRPO run of SmolLM2-135M-Instruct on GSM8K, reward printed per step.
demo: build
	$(BUILD)/troupe run configs/demo.yaml

# Each benchmark runs troupe and its peer in one process and prints both sides and the ratio.
# async_overlap runs one prompt x G=6 completions of up to 192 tokens per step, so decoding
# (latency-bound on a CPU) and training take similar time, as its goal asks.
bench: build
	$(PY) bench/forward_throughput.py --troupe $(BUILD)/troupe --bench $(BUILD)/bench/bench_forward --model $(MODEL) --work $(BUILD)/bench_models/smollm2
	$(PY) bench/generation_throughput.py --troupe $(BUILD)/troupe --bench $(BUILD)/bench/bench_generate --model $(MODEL) --work $(BUILD)/bench_models/smollm2
	$(PY) bench/decode_llamacpp.py --bench $(BUILD)/bench/bench_decode --model $(MODEL)
	$(PY) bench/serve_load.py --troupe $(BUILD)/troupe --model $(MODEL)
	$(PY) bench/sft_throughput.py --troupe $(BUILD)/troupe --bench $(BUILD)/bench/bench_sft --model $(MODEL) --work $(BUILD)/bench_models/smollm2
	$(PY) bench/sft_parallel.py --troupe $(BUILD)/troupe --bench $(BUILD)/bench/bench_sft --model $(MODEL) --work $(BUILD)/bench_models/smollm2 --sharding zero2
	$(PY) bench/sft_parallel.py --troupe $(BUILD)/troupe --bench $(BUILD)/bench/bench_sft --model $(MODEL) --work $(BUILD)/bench_models/smollm2 --sharding zero3
	$(PY) bench/cluster_processes.py --troupe $(BUILD)/troupe --config configs/tiny_arithmetic_grpo.yaml --steps 60
	$(PY) bench/async_overlap.py --troupe $(BUILD)/troupe --config configs/demo.yaml --steps 20 --set trainer.batch_groups=1 generator.group_size=6 generator.max_tokens=192

clean:
	rm -rf $(BUILD)
