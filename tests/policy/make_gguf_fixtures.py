# GGUF fixtures for test_gguf.cpp: small files written by gguf-py, references from gguf-py's numpy
# dequantizer and transformers' GGUF loader. No corrupt files: the C++ test mutates types.gguf itself.
#
#   .venv/bin/python tests/policy/make_gguf_fixtures.py build/fixtures/gguf   (CTest runs this)
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)
ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

rng = np.random.default_rng(20240611)


def save_f32(name: str, a: np.ndarray) -> str:
    file = name + ".f32"
    np.ascontiguousarray(a, dtype="<f4").tofile(OUT / file)
    return file


# --- types.gguf: one tensor per type, and metadata of every value type -------------------------

def fp16_bytes(values) -> np.ndarray:
    return np.asarray(values, dtype="<f2").view(np.uint8)


def random_k_blocks(qtype: Q, rows: int, cols: int) -> np.ndarray:
    # gguf-py cannot quantize the K types; random bytes exercise every bit of the layout, and
    # the fp16 super-block scales are overwritten with small finite values so outputs are finite.
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    n = blocks.shape[0]
    if qtype == Q.Q4_K:  # d, dmin at the front
        blocks[:, 0:2] = fp16_bytes(rng.uniform(-0.05, 0.05, n)).reshape(n, 2)
        blocks[:, 2:4] = fp16_bytes(rng.uniform(-0.05, 0.05, n)).reshape(n, 2)
    elif qtype == Q.Q6_K:  # d at the end
        blocks[:, size - 2:size] = fp16_bytes(rng.uniform(-0.05, 0.05, n)).reshape(n, 2)
    elif qtype == Q.Q2_K:  # d, dmin at the end
        blocks[:, size - 4:size] = fp16_bytes(rng.uniform(-0.05, 0.05, 2 * n)).reshape(n, 4)
    return blocks.reshape(rows, cols // block * size)


w = gguf.GGUFWriter(OUT / "types.gguf", "llama")
w.add_uint8("test.u8", 200)
w.add_int8("test.i8", -100)
w.add_uint16("test.u16", 60000)
w.add_int16("test.i16", -30000)
w.add_uint32("test.u32", 4000000000)
w.add_int32("test.i32", -2000000000)
w.add_uint64("test.u64", 18000000000000000000)
w.add_int64("test.i64", -9000000000000000000)
w.add_float32("test.f32", 1.5)
w.add_float64("test.f64", -2.25e100)
w.add_bool("test.true", True)
w.add_bool("test.false", False)
w.add_string("test.string", "héllo wörld")
w.add_key_value("test.empty_string", "", gguf.GGUFValueType.STRING)  # add_string skips ""
w.add_array("test.strings", ["a", "bc", "", "déf"])
w.add_key_value("test.u8s", [1, 2, 255], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8)
w.add_array("test.i32s", [-1, 0, 7])
w.add_key_value("test.i64s", [-(2**40), 2**40], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT64)
w.add_array("test.f32s", [0.5, -1.25])
w.add_array("test.bools", [True, False, True])
w.add_array("test.nested", [[1, 2], [3], ["x", "y"]])

def add(w: gguf.GGUFWriter, expected: dict, name: str, qtype: Q, data: np.ndarray, ref: np.ndarray | None = None):
    if qtype == Q.F32:
        w.add_tensor(name, data.astype(np.float32))
        ref = data.astype(np.float32)
    elif qtype == Q.F16:
        w.add_tensor(name, data.astype(np.float16))
        ref = gguf.quants.dequantize(data.astype(np.float16).view(np.uint8), Q.F16)
    elif ref is None:  # data is float: quantize it with gguf-py
        raw = gguf.quants.quantize(data.astype(np.float32), qtype)
        w.add_tensor(name, raw, raw_dtype=qtype)
        ref = gguf.quants.dequantize(raw, qtype)
    else:  # data is raw bytes
        w.add_tensor(name, data, raw_dtype=qtype)
    ref = np.asarray(ref, dtype=np.float32)
    expected[name] = {"type": qtype.name, "shape": list(ref.shape), "file": save_f32(w.path.stem + "." + name, ref)}


specials = np.array([np.inf, -np.inf, np.nan, -0.0, 6e-8, 3e-5, 65504.0, -65504.0, 1.0, -2.0],
                    dtype=np.float32)
f16 = rng.normal(size=(4, 64)).astype(np.float32)
f16.flat[:len(specials)] = specials
bf16 = rng.normal(size=(4, 64)).astype(np.float32) * 1e3
bf16.flat[:4] = [np.inf, -np.inf, 1e-40, -0.0]  # 1e-40 is a float32 subnormal

expected = {}
add(w, expected, "t_f32", Q.F32, rng.normal(size=(2, 3, 64)))
add(w, expected, "t_f16", Q.F16, f16)
add(w, expected, "t_bf16", Q.BF16, bf16)
for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
    x = rng.normal(size=(4, 96)).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero block: d = 0
    add(w, expected, "t_" + qtype.name.lower(), qtype, x)
for qtype in (Q.Q4_K, Q.Q6_K):
    raw = random_k_blocks(qtype, 3, 512)
    add(w, expected, "t_" + qtype.name.lower(), qtype, raw, gguf.quants.dequantize(raw, qtype))
# Known to ggml but not dequantized by troupe: opens, then dequantize() refuses it.
w.add_tensor("t_q2_k", random_k_blocks(Q.Q2_K, 1, 256), raw_dtype=Q.Q2_K)

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()

reader = gguf.GGUFReader(OUT / "types.gguf")
(OUT / "types.json").write_text(json.dumps(
    {"tensors": expected, "data_offset": reader.data_offset,
     "file_size": (OUT / "types.gguf").stat().st_size}, indent=1))


# A 64-byte aligned file whose first tensor (7 floats) needs padding before the second.
w = gguf.GGUFWriter(OUT / "align64.gguf", "llama")
w.add_custom_alignment(64)
aligned = {}
add(w, aligned, "a", Q.F32, rng.normal(size=7))
add(w, aligned, "b", Q.Q8_0, rng.normal(size=(2, 32)))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
(OUT / "align64.json").write_text(json.dumps({"tensors": aligned}, indent=1))


# --- small config files: one per hf_config() branch ------------------------------------------

def config_file(name: str, arch: str, kv: dict, tensors: list[str], tokens: int = 0):
    w = gguf.GGUFWriter(OUT / name, arch)
    for key, (fn, value) in kv.items():
        getattr(w, "add_" + fn)(key.replace("ARCH", arch), value)
    if tokens:
        w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(tokens)])
    for t in tensors:
        w.add_tensor(t, np.zeros(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


base = {
    "ARCH.embedding_length": ("uint32", 64),
    "ARCH.feed_forward_length": ("uint32", 96),
    "ARCH.block_count": ("uint32", 2),
    "ARCH.attention.head_count": ("uint32", 4),
    "ARCH.attention.head_count_kv": ("uint32", 2),
    "ARCH.attention.layer_norm_rms_epsilon": ("float32", 1e-6),
    "ARCH.context_length": ("uint32", 512),
}
# qwen3: head_dim from key_length, vocab from the token list, default rope_theta, untied.
config_file("qwen3.gguf", "qwen3", base | {"ARCH.attention.key_length": ("uint32", 32),
                                           "tokenizer.ggml.bos_token_id": ("uint32", 5),
                                           "tokenizer.ggml.eos_token_id": ("uint32", 6)},
            ["output.weight", "blk.0.attn_q_norm.weight"], tokens=40)
# qwen2: q/k/v biases, explicit vocab size and rope base.
config_file("qwen2.gguf", "qwen2", base | {"ARCH.vocab_size": ("uint32", 100),
                                           "ARCH.rope.freq_base": ("float32", 1e6),
                                           "tokenizer.ggml.padding_token_id": ("uint32", 7)},
            ["blk.0.attn_q.bias"])
config_file("mamba.gguf", "mamba", base, [])

# llama 3.x: RoPE scaling travels only as rope_freqs.weight, the converter's per-frequency
# divisors. transformers' own llama3 RoPE gives the reference: divisor = default / scaled.
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

llama3_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=131072,
                  rope_parameters=llama3_rope)
scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
default = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))  # as transformers
rope_freqs = (default / scaled).numpy()
for name, freqs in [("llama3.gguf", rope_freqs), ("llama3_odd_rope.gguf", rope_freqs[::-1].copy())]:
    w = gguf.GGUFWriter(OUT / name, "llama")
    for key, (fn, value) in (base | {"ARCH.embedding_length": ("uint32", 256),
                                     "ARCH.rope.freq_base": ("float32", 500000.0),
                                     "ARCH.vocab_size": ("uint32", 128)}).items():
        getattr(w, "add_" + fn)(key.replace("ARCH", "llama"), value)
    w.add_tensor("rope_freqs.weight", freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
config_file("no_block_count.gguf", "llama",
            {k: v for k, v in base.items() if k != "ARCH.block_count"}, [], tokens=8)


# --- SmolLM2 references from transformers' GGUF loader ----------------------------------------
# transformers dequantizes with gguf-py and un-permutes q/k with its own code; that is the
# independent reference for troupe's dequantize() + unpermute_qk_rows(). from_pretrained(...,
# gguf_file=) needs accelerate, which the project does not install, so this calls the loader
# underneath it on a randomly initialised model (used only for its parameter names).
if SMOLLM2.exists():
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = load_gguf_checkpoint(str(SMOLLM2), return_tensors=True, model_to_load=model)["tensors"]
    refs = {}
    for name, rows in [("model.layers.0.self_attn.q_proj.weight", None),
                       ("model.layers.0.self_attn.k_proj.weight", None),
                       ("model.layers.0.self_attn.v_proj.weight", None),
                       ("model.layers.0.mlp.down_proj.weight", None),
                       ("model.layers.29.self_attn.k_proj.weight", None),
                       ("model.layers.29.input_layernorm.weight", None),
                       ("model.embed_tokens.weight", 16),
                       ("model.norm.weight", None)]:
        t = state[name].to(torch.float32).numpy()
        if rows is not None:
            t = t[:rows]
        refs[name] = {"shape": list(t.shape), "file": save_f32("smollm2." + name, t)}
    (OUT / "smollm2.json").write_text(json.dumps(
        {"tensors": refs, "config": config.to_diff_dict() | {
            k: getattr(config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "head_dim",
                                            "rms_norm_eps", "vocab_size", "max_position_embeddings",
                                            "tie_word_embeddings", "bos_token_id", "eos_token_id")}},
        indent=1, default=str))
