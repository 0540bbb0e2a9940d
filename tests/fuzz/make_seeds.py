"""Seed corpora for the fuzz harnesses, made from the test fixtures and the repository's data.

    python3 tests/fuzz/make_seeds.py FIXTURES_DIR OUT_DIR

FIXTURES_DIR is the main build's build/fixtures (made by ctest's fixture_* tests); OUT_DIR gets one
folder per harness (OUT_DIR/<harness>/) and a libFuzzer dictionary per harness (OUT_DIR/<harness>.dict).
Seeds stay small (a few KB): large ones would set libFuzzer's input length and slow every run,
so the 1.5 MB tokenizer.json and 6 MB tokenizer GGUF fixtures are cut down to their first few
hundred tokens (with the merges among them), keeping their pre-tokenizers, normalizers and added
tokens. Only the standard library: it runs with any python3. Missing fixtures are skipped, so a
partial fixture folder still gives seeds.
"""
import hashlib
import json
import shutil
import struct
import sys
from pathlib import Path

FIXTURES = Path(sys.argv[1])
OUT = Path(sys.argv[2])
ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = ROOT.parent / "shared" / "data"
MAX_SEED = 64 * 1024

counts = {}


def seed(harness, data, name=None):
    if isinstance(data, str):
        data = data.encode()
    if len(data) > MAX_SEED:
        return
    folder = OUT / harness
    folder.mkdir(parents=True, exist_ok=True)
    name = name or hashlib.sha1(data).hexdigest()[:16]
    (folder / name).write_bytes(data)
    counts[harness] = counts.get(harness, 0) + 1


def dictionary(harness, words):
    (OUT / harness).mkdir(parents=True, exist_ok=True)  # a harness without seeds starts from nothing
    lines = []
    for b in sorted({w.encode() if isinstance(w, str) else w for w in words}):
        esc = "".join(chr(c) if 0x20 <= c < 0x7F and c not in (0x22, 0x5C) else f"\\x{c:02x}" for c in b)
        lines.append(f'"{esc}"')
    (OUT / f"{harness}.dict").write_text("\n".join(lines) + "\n")


def files(pattern_root, pattern):
    return sorted(p for p in Path(pattern_root).glob(pattern) if p.is_file()) if Path(pattern_root).exists() else []


def jsonl_lines(path, n):
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as f:
        return [line for _, line in zip(range(n), f)]


# --- safetensors --------------------------------------------------------------------------------

for p in files(FIXTURES, "safetensors/**/*.safetensors") + files(FIXTURES, "ppo_value_head/*.safetensors"):
    seed("safetensors", p.read_bytes())
dictionary("safetensors", ['"dtype"', '"shape"', '"data_offsets"', '"__metadata__"', '"format"', '"pt"', "F64", "F32",
                           "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "18446744073709551615",
                           "9223372036854775807", "-1", "1e308", "[]", "{}"])

# --- sharded checkpoints: model.safetensors.index.json and two shards' headers -----------------
# The harness writes each shard's data section itself (zeros), so a seed holds the index, NUL, the
# first shard's header JSON, NUL, the second's, for the shard names the harness writes.

SHARD_NAMES = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def st_header(path):
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n])


def sharded_seed(headers, extra_index=None):
    weight_map = {name: SHARD_NAMES[i] for i, h in enumerate(headers) for name in h if name != "__metadata__"}
    total = sum(e["data_offsets"][1] - e["data_offsets"][0] for h in headers for k, e in h.items() if k != "__metadata__")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    index.update(extra_index or {})
    return "\0".join([json.dumps(index, indent=2) + "\n"] + [json.dumps(h, separators=(",", ":")) for h in headers])


def tiled(tensors, metadata=None):
    """A header whose tensors tile the data section in the order given: [(name, dtype, shape)]."""
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "U8": 1}
    h, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for name, dtype, shape in tensors:
        n = sizes[dtype]
        for d in shape:
            n *= d
        h[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    return h


seed("safetensors_index", sharded_seed([tiled([("model.embed_tokens.weight", "F32", [8, 4]),
                                               ("model.norm.weight", "F32", [4])], {"format": "pt"}),
                                        tiled([("lm_head.weight", "BF16", [8, 4]), ("scalar", "I64", []),
                                               ("empty", "F16", [0, 3])], {"format": "pt"})]))
seed("safetensors_index", sharded_seed([tiled([("w", "U8", [3])])]))
seed("safetensors_index", sharded_seed([tiled([("w", "U8", [3])])], {"metadata": [[[[[[[[[[[[[[[[{}]]]]]]]]]]]]]]]]}))
shards = files(FIXTURES, "safetensors/sharded/model-*.safetensors")
if len(shards) >= 2:
    headers = [st_header(p) for p in shards[:2]]
    seed("safetensors_index", sharded_seed(headers))
    # The fixture's index as transformers wrote it, its third shard missing.
    index_path = FIXTURES / "safetensors/sharded/model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text(encoding="utf-8"))
        renamed = {Path(p).name: SHARD_NAMES[i] for i, p in enumerate(shards[:2])}
        index["weight_map"] = {k: renamed.get(v, v) for k, v in index["weight_map"].items()}
        seed("safetensors_index", "\0".join([json.dumps(index, indent=2)] + [json.dumps(h) for h in headers]))
dictionary("safetensors_index", ['"weight_map"', '"metadata"', '"total_size"', '"dtype"', '"shape"', '"data_offsets"',
                                 '"__metadata__"', "F32", "BF16", "I64", "U8", SHARD_NAMES[0], SHARD_NAMES[1],
                                 "model.safetensors", "model.safetensors.index.json", "..", "/", "\\u0000",
                                 "18446744073709551615", "[]", "{}", "null", b"\x00"])

# --- config.json and adapter_config.json --------------------------------------------------------

HF_COMMON = {"vocab_size": 160, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
             "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "float32"}
hf_configs = [
    {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **HF_COMMON, "rope_theta": 500000.0,
     "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}},
    {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **HF_COMMON, "rope_theta": 1000000.0,
     "use_sliding_window": False, "sliding_window": 4096, "tie_word_embeddings": False},
    {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **HF_COMMON, "head_dim": 24,
     "attention_bias": False, "eos_token_id": [2, 3], "pad_token_id": 0, "tie_word_embeddings": True},
    # transformers 5: rope_theta and the scaling folded into rope_parameters.
    {"model_type": "llama", **HF_COMMON, "tie_word_embeddings": True,
     "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
]
for c in hf_configs:
    seed("model_config", json.dumps(c, indent=2))
for p in files(FIXTURES, "hf_models/*/config.json"):
    seed("model_config", p.read_bytes())
seed("model_config", json.dumps(hf_configs[0])[:-1] + ', "quantization_config": ' + "[" * 80 + "]" * 80 + "}")
dictionary("model_config", ['"architectures"', '"model_type"', '"vocab_size"', '"hidden_size"', '"intermediate_size"',
                            '"num_hidden_layers"', '"num_attention_heads"', '"num_key_value_heads"', '"head_dim"',
                            '"max_position_embeddings"', '"rms_norm_eps"', '"rope_theta"', '"rope_scaling"',
                            '"rope_parameters"', '"rope_type"', '"type"', '"factor"', '"low_freq_factor"',
                            '"high_freq_factor"', '"original_max_position_embeddings"', '"tie_word_embeddings"',
                            '"attention_bias"', '"mlp_bias"', '"hidden_act"', '"use_sliding_window"', '"bos_token_id"',
                            '"eos_token_id"', '"pad_token_id"', '"LlamaForCausalLM"', '"Qwen2ForCausalLM"',
                            '"Qwen3ForCausalLM"', '"llama"', '"qwen2"', '"qwen3"', '"llama3"', '"default"', '"silu"',
                            "9223372036854775807", "9223372036854775808", "4611686018427387904", "4294967296",
                            "2147483648", "-1", "0", "1e309", "1e-320",
                            "null", "true", "false", "[]", "{}"])

adapter_configs = [
    {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "r": 8, "lora_alpha": 16,
     "lora_dropout": 0.1, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "use_rslora": False,
     "bias": "none", "fan_in_fan_out": False, "use_dora": False, "lora_bias": False, "init_lora_weights": True,
     "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
     "layers_to_transform": None, "layers_pattern": None, "exclude_modules": None, "revision": None},
    {"peft_type": "LORA", "r": 2, "lora_alpha": 4.5, "use_rslora": True,
     "target_modules": ["gate_proj", "up_proj", "down_proj"], "layer_replication": [], "target_parameters": []},
]
for c in adapter_configs:
    seed("adapter_config", json.dumps(c, indent=2))
for p in files(FIXTURES, "lora/*/adapter_config.json"):
    seed("adapter_config", p.read_bytes())
seed("adapter_config", json.dumps(adapter_configs[1])[:-1] + ', "modules_to_save": ' + "[" * 80 + "]" * 80 + "}")
dictionary("adapter_config", ['"peft_type"', '"LORA"', '"r"', '"lora_alpha"', '"lora_dropout"', '"target_modules"',
                              '"use_rslora"', '"bias"', '"none"', '"all"', '"use_dora"', '"fan_in_fan_out"',
                              '"lora_bias"', '"rank_pattern"', '"alpha_pattern"', '"layers_to_transform"',
                              '"modules_to_save"', '"exclude_modules"', '"layer_replication"',
                              '"trainable_token_indices"', '"target_parameters"', '"q_proj"', '"down_proj"',
                              "9223372036854775808", "4611686018427387904", "-1", "0", "1e309", "0.99999999999999999",
                              "null", "true",
                              "[]", "{}"])

# --- GGUF ---------------------------------------------------------------------------------------

GGUF_STRING, GGUF_ARRAY, GGUF_UINT32, GGUF_INT32 = 8, 9, 4, 5


def gguf_string(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def gguf_kv(key, vtype, value):
    out = gguf_string(key) + struct.pack("<I", vtype)
    if vtype == GGUF_STRING:
        return out + gguf_string(value)
    if vtype == GGUF_UINT32:
        return out + struct.pack("<I", value)
    if vtype == GGUF_ARRAY:
        etype, items = value
        out += struct.pack("<IQ", etype, len(items))
        for item in items:
            out += gguf_string(item) if etype == GGUF_STRING else struct.pack("<i", item)
        return out
    raise ValueError(vtype)


def gguf_file(kvs):
    body = b"".join(gguf_kv(*kv) for kv in kvs)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + body


def small_vocab(tokenizer_json, n):
    """The first n ids of a tokenizer.json (ids renumbered densely), the merges among them, and the
    ids of its added tokens."""
    doc = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    model = doc["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])[:n]
    tokens = [t for t, _ in by_id]
    kept = set(tokens)
    merges = []
    for m in model["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in kept and b in kept and a + b in kept:
            merges.append(f"{a} {b}")
    added = {t["content"] for t in doc.get("added_tokens", [])}
    return doc, tokens, merges, added


gguf_words = ["GGUF", "general.architecture", "general.alignment", "llama", "qwen2", "qwen3", "tokenizer.ggml.model",
              "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
              "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
              "tokenizer.chat_template", "gpt2", "smollm", "llama-bpe", "gpt-2", "rope_freqs.weight", "output.weight",
              "token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_q.bias", ".embedding_length",
              ".attention.head_count", ".attention.head_count_kv", ".rope.dimension_count", ".rope.scaling.type",
              ".context_length", ".block_count", ".feed_forward_length", ".attention.layer_norm_rms_epsilon",
              "yarn", "linear", b"\xff\xff\xff\xff\xff\xff\xff\xff", b"\x00\x00\x00\x00\x00\x00\x00\x80"]
for p in files(FIXTURES, "gguf/*.gguf") + files(FIXTURES, "tokenizer/gguf/*.gguf"):
    seed("gguf", p.read_bytes())
for p in files(FIXTURES, "tokenizer/gguf/bad_*.gguf"):
    seed("gguf_tokenizer", p.read_bytes())

chat_templates = []
if (FIXTURES / "tokenizer/chat_templates.json").exists():
    chat_templates = json.loads((FIXTURES / "tokenizer/chat_templates.json").read_text(encoding="utf-8"))
chatml_source = next((t["source"] for t in chat_templates if t["name"] == "smollm2"), "")
tokenizer_sources = [(FIXTURES / "tokenizer/smollm2/tokenizer.json", ["smollm", "gpt-2"]),
                     (SHARED_DATA / "tokenizers/qwen3/tokenizer.json", ["qwen2", "llama-bpe"])]
for path, pres in tokenizer_sources:
    if not path.exists():
        continue
    _, tokens, merges, added = small_vocab(path, 400)
    types = [3 if t in added else 1 for t in tokens]
    for pre in pres:
        kvs = [("tokenizer.ggml.model", GGUF_STRING, "gpt2"), ("tokenizer.ggml.pre", GGUF_STRING, pre),
               ("tokenizer.ggml.tokens", GGUF_ARRAY, (GGUF_STRING, tokens)),
               ("tokenizer.ggml.token_type", GGUF_ARRAY, (GGUF_INT32, types)),
               ("tokenizer.ggml.merges", GGUF_ARRAY, (GGUF_STRING, merges)),
               ("tokenizer.ggml.eos_token_id", GGUF_UINT32, 0)]
        if chatml_source:
            kvs.append(("tokenizer.chat_template", GGUF_STRING, chatml_source))
        seed("gguf_tokenizer", gguf_file(kvs))
dictionary("gguf", gguf_words)
dictionary("gguf_tokenizer", gguf_words)

# --- tokenizer.json -----------------------------------------------------------------------------

texts = ["Hello world! 12345", "  leading spaces\tand tabs\n\nnew lines", "café naïve 東京 🎉", "<|im_start|>user\nhi<|im_end|>"]
for path in [FIXTURES / "tokenizer/smollm2/tokenizer.json"] + files(FIXTURES, "tokenizer/variants/*/tokenizer.json"):
    if not path.exists():
        continue
    doc, tokens, merges, added = small_vocab(path, 350)
    # Added tokens keep their ids above the cut vocabulary, as in the originals.
    doc["model"]["vocab"] = {t: i for i, t in enumerate(tokens)}
    doc["model"]["merges"] = merges
    next_id = len(tokens)
    for t in doc.get("added_tokens", []):
        if t["content"] not in doc["model"]["vocab"]:
            t["id"] = next_id
            next_id += 1
        else:
            t["id"] = doc["model"]["vocab"][t["content"]]
    corpus = path.parent.parent / (path.parent.name + ".jsonl") if "variants" in path.parts else None
    lines = [json.loads(l)["text"] for l in jsonl_lines(corpus, 3)] if corpus else []
    for text in (lines or texts)[:3]:
        seed("tokenizer_json", json.dumps(doc, ensure_ascii=False).encode() + b"\0" + text.encode()[:512])
for p in [FIXTURES / "sft/bytes/tokenizer.json"] + files(FIXTURES, "tokenizer/bad/*.json"):
    if p.exists():
        seed("tokenizer_json", p.read_bytes() + b"\0" + texts[0].encode())
dictionary("tokenizer_json", ['"model"', '"vocab"', '"merges"', '"added_tokens"', '"normalizer"', '"pre_tokenizer"',
                              '"decoder"', '"type"', '"BPE"', '"ByteLevel"', '"Sequence"', '"Split"', '"Digits"',
                              '"NFC"', '"pretokenizers"', '"normalizers"', '"pattern"', '"Regex"', '"String"',
                              '"behavior"', '"Isolated"', '"Removed"', '"MergedWithPrevious"', '"MergedWithNext"',
                              '"Contiguous"', '"invert"', '"add_prefix_space"', '"use_regex"', '"individual_digits"',
                              '"ignore_merges"', '"fuse_unk"', '"unk_token"', '"byte_fallback"', '"dropout"',
                              '"continuing_subword_prefix"', '"end_of_word_suffix"', '"id"', '"content"', '"special"',
                              '"single_word"', '"lstrip"', '"rstrip"', '"normalized"', "true", "false", "null",
                              "\\\\p{L}", "\\\\s+(?!\\\\S)", "(?i:", "\\\\Q", "[^", "\\u0120", "#version"])

# --- chat templates -----------------------------------------------------------------------------

ROLE_LETTER = {"system": "s", "user": "u", "assistant": "a"}
for t in chat_templates:
    for case in t["cases"][:6]:
        parts = [t["source"]] + [ROLE_LETTER.get(m["role"], "x") + m["content"] for m in case["messages"]]
        seed("chat_template", "\0".join(parts))
dictionary("chat_template", ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                             "<think>", "</think>", "reasoning_content", "bos_token", "Cutting Knowledge Date: ",
                             "set date_string = \"", "strftime_now", "<tool_response>", "</tool_response>",
                             "<|im_start|>system\\n", "\\n", "\\x00a", "\\x00u", "\\x00s"])

# --- the run config -----------------------------------------------------------------------------

OVERRIDES = [[], ["trainer.lr=1e-6", "rewards.0.weight=2"], ["generator.stop=[\"###\", \"\\t\"]", "run.seed=7"],
             ["trainer.loss.clip=[0.1, 0.3]", "async.max_staleness=0"], ["data.eval={path: e.jsonl, limit: 5}"]]
config_words = set()
for i, p in enumerate(files(ROOT, "configs/*.yaml")):
    text = p.read_text(encoding="utf-8")
    for ov in OVERRIDES[: 2 if i % 2 else len(OVERRIDES)]:
        seed("config", "\0".join([text] + ov))
    for line in text.splitlines():
        key = line.split("#", 1)[0].strip().lstrip("- ").split(":", 1)[0].strip()
        if key and key.replace("_", "").isalnum():
            config_words.add(key + ":")
dictionary("config", sorted(config_words) + ["=", ".0.", "[", "]", "{", "}", "&a", "*a", "<<:", "!!str", "~", "null",
                                             ".inf", ".nan", "-", "true", "false", "1e309", "18446744073709551616"])

# --- JSONL readers ------------------------------------------------------------------------------

json_words = ['"prompt"', '"question"', '"answer"', '"completion"', '"messages"', '"role"', '"content"', '"system"',
              '"user"', '"assistant"', '"chosen"', '"rejected"', "null", "true", "1e999", "\\u0000", "\\ud800", "\\n",
              "<|im_start|>", "<|im_end|>", "<|eot_id|>", "</think>", "<think>"]
prompt_files = [ROOT / "data/arithmetic_train.jsonl", FIXTURES / "arithmetic/train.jsonl",
                SHARED_DATA / "gsm8k/train.jsonl"]
for p in prompt_files:
    for n in (1, 4):
        lines = jsonl_lines(p, n)
        if lines:
            seed("prompts", "".join(lines))
for p in [FIXTURES / "arithmetic/format.jsonl", SHARED_DATA / "gsm8k/train.jsonl"]:
    lines = jsonl_lines(p, 3)
    if lines:
        seed("sft_jsonl", "".join(lines))
if (FIXTURES / "sft/chat_masks.json").exists():
    for case in json.loads((FIXTURES / "sft/chat_masks.json").read_text(encoding="utf-8")):
        seed("sft_jsonl", json.dumps({"messages": case["messages"]}, ensure_ascii=False) + "\n")
for p in [FIXTURES / "arithmetic/prefs.jsonl", ROOT / "data/gsm8k_preferences.jsonl"]:
    for n in (1, 3):
        lines = jsonl_lines(p, n)
        if lines:
            seed("dpo_jsonl", "".join(lines))
for harness in ("prompts", "sft_jsonl", "dpo_jsonl"):
    dictionary(harness, json_words)

# --- checkpoints: rollouts.msgpack and trainer_state.json ---------------------------------------


def msgpack(v):
    """The subset of msgpack that nlohmann's to_msgpack writes for rollout groups."""
    if v is None:
        return b"\xc0"
    if v is True or v is False:
        return b"\xc3" if v else b"\xc2"
    if isinstance(v, int):
        if 0 <= v < 128:
            return bytes([v])
        if -32 <= v < 0:
            return struct.pack("b", v)
        return b"\xcf" + struct.pack(">Q", v) if v > 0 else b"\xd3" + struct.pack(">q", v)
    if isinstance(v, float):
        return b"\xcb" + struct.pack(">d", v)
    if isinstance(v, str):
        b = v.encode()
        return (bytes([0xA0 | len(b)]) if len(b) < 32 else b"\xd9" + bytes([len(b)]) if len(b) < 256
                else b"\xda" + struct.pack(">H", len(b))) + b
    if isinstance(v, list):
        head = bytes([0x90 | len(v)]) if len(v) < 16 else b"\xdc" + struct.pack(">H", len(v))
        return head + b"".join(msgpack(x) for x in v)
    if isinstance(v, dict):
        head = bytes([0x80 | len(v)]) if len(v) < 16 else b"\xde" + struct.pack(">H", len(v))
        return head + b"".join(msgpack(k) + msgpack(x) for k, x in v.items())
    raise TypeError(type(v))


def group(ticket, g, failed=False, reference=False):
    completions = [[ticket % 7 + i, 12, 3] for i in range(g)]
    return {"prompt_id": ticket, "batch": ticket // 2, "prompt_ids": [1, 2, 3, 4], "completion_ids": completions,
            "behaviour_logprobs": [[-0.5, -1.25, -0.125] for _ in completions],
            "reference_logprobs": [[-0.75, -1.0, -0.25] for _ in completions] if reference else [],
            "min_version": [ticket // 2] * g, "max_version": [ticket // 2] * g, "truncated": [0, 1][:g] + [0] * (g - 2),
            "rewards": {} if failed else {"correct": [1.0, 0.0][:g] + [0.0] * (g - 2)},
            "reward": [] if failed else [1.0, 0.0][:g] + [0.0] * (g - 2),
            "metadata": '{"answer": "7"}', "ticket": ticket, "error": "reward: timed out" if failed else "",
            "generate_s": 0.25}


# Hand-made groups first, so the corpus does not depend on which test runs left checkpoints behind.
seed("rollouts", msgpack([group(0, 2), group(1, 2)]))
seed("rollouts", msgpack([group(4, 3, reference=True), group(5, 2, failed=True)]))
seed("trainer_state", json.dumps({"format": 1, "recipe": "grpo", "model": "m", "step": 4, "policy_version": 4,
                                  "rollout_batches": [4, 5], "rollouts": "rollouts.msgpack", "refilled": 1}))
seed("trainer_state", json.dumps({"format": 1, "recipe": "sft", "model": "m", "step": 3, "policy_version": 3,
                                  "cursor": {"epoch": 1, "position": 2}}))

rollouts = sorted(files(FIXTURES, "*/checkpoints/step_*/rollouts.msgpack"), key=lambda p: (p.stat().st_size, str(p)))
runs_seen = set()
for p in rollouts:
    run = p.parts[-4]
    kind = run.split("_")[0] + ("ppo" if "ppo" in run else "") + ("dpo" if "dpo" in run else "")
    if p.stat().st_size > 1 and kind not in runs_seen and len(runs_seen) < 12:
        runs_seen.add(kind)
        seed("rollouts", p.read_bytes())
seed("rollouts", b"\x90")  # an empty array
dictionary("rollouts", ["prompt_id", "batch", "prompt_ids", "completion_ids", "behaviour_logprobs",
                        "reference_logprobs", "min_version", "max_version", "truncated", "rewards", "reward",
                        "metadata", "ticket", "error", "generate_s", b"\xcb\x7f\xf0\x00\x00\x00\x00\x00\x00",
                        b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00"])
for p in files(FIXTURES, "*/checkpoints/step_*/trainer_state.json"):
    seed("trainer_state", p.read_bytes())
dictionary("trainer_state", ['"format"', '"recipe"', '"model"', '"step"', '"policy_version"', '"cursor"',
                             '"rollout_batches"', '"rollouts"', '"refilled"', '"epoch"', '"position"',
                             "9223372036854775808", "-9223372036854775809", "1.5", "null", "[]", "{}"])

# troupe serve's request bodies: a route byte (0 completions, 1 chat, 2 tokenize, 3 detokenize),
# then the body, as the vLLM clients and tests/generator/serve_abuse.py send them.
serve_bodies = [
    (0, {"model": "fuzz", "prompt": "the answer is", "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
         "min_p": 0.05, "n": 2, "seed": 3, "stop": ["\n", "."], "logprobs": 1, "return_token_ids": True}),
    (0, {"prompt": [[1, 2, 3], "text", [4]], "max_tokens": 4, "stop_token_ids": [5], "ignore_eos": True}),
    (0, {"prompt": [7, 8, 9], "stream": True, "stream_options": {"include_usage": True}, "echo": False, "best_of": 1}),
    (1, {"model": "fuzz", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
         "max_completion_tokens": 8, "logprobs": True, "top_logprobs": 2, "add_generation_prompt": True}),
    (1, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "stream": True, "tools": [], "tool_choice": "none"}),
    (2, {"prompt": "the theme", "return_token_strs": True}),
    (2, {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False}),
    (3, {"tokens": [104, 101, 256, 257]}),
]
for route, body in serve_bodies:
    seed("serve_request", bytes([route]) + json.dumps(body).encode())
seed("serve_request", b"\x00")
seed("serve_request", b"\x00" + b"[" * 80)
dictionary("serve_request", ['"model"', '"prompt"', '"messages"', '"role"', '"content"', '"type"', '"text"', '"n"',
                             '"max_tokens"', '"max_completion_tokens"', '"temperature"', '"top_p"', '"top_k"', '"min_p"',
                             '"seed"', '"stop"', '"stop_token_ids"', '"ignore_eos"', '"logprobs"', '"top_logprobs"',
                             '"stream"', '"stream_options"', '"include_usage"', '"continuous_usage_stats"', '"tokens"',
                             '"return_token_ids"', '"return_tokens_as_token_ids"', '"add_generation_prompt"',
                             '"include_stop_str_in_output"', '"return_token_strs"', '"user"', '"assistant"',
                             '"system"', "1e309", "-1", "0", "16.0", "4294967296", "9223372036854775808", "null",
                             "true", "[]", "{}", "\\u0000", "\\ud800"])

print("fuzz seeds in " + str(OUT) + ": " + ", ".join(f"{h} {n}" for h, n in sorted(counts.items())))
