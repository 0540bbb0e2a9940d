# The fuzz harnesses, one per parser: tests/fuzz/fuzz_<name>.cpp. Read by tests/fuzz/CMakeLists.txt
# (the executables), tests/CMakeLists.txt (a ctest test each) and scripts/fuzz.sh (the runs).
set(TROUPE_FUZZ_HARNESSES
    safetensors safetensors_index model_config adapter_config gguf tokenizer_json gguf_tokenizer chat_template config
    prompts sft_jsonl dpo_jsonl rollouts trainer_state serve_request)
