# Reference safetensors files for test_safetensors, written by the Python `safetensors` package
# and transformers' save_pretrained; expected bytes come from torch, never from the files.
#
#   make_safetensors_fixtures.py OUT_DIR          write the fixtures (CTest runs this)
#   make_safetensors_fixtures.py --dump PATH JSON  read PATH (a file or a checkpoint folder)
#                                                  with the reference reader and describe it
#                                                  as JSON, so the C++ test can check that
#                                                  what troupe writes loads in Python too.
import json
import math
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def describe(t: torch.Tensor) -> dict:
    t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    values = t.to(torch.float64).reshape(-1).tolist() if t.is_floating_point() else t.reshape(-1).tolist()
    return {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "hex": raw.numpy().tobytes().hex(),
            "values": [float(v) if isinstance(v, float) else int(v) for v in values]}


def dtypes_fixture(out: str) -> None:
    # Values exactly representable in their dtype, including the edges a decoder gets wrong:
    # f16 max, smallest normal and a subnormal; bf16 near its max; odd byte counts.
    tensors = {
        "f32": torch.tensor([[1.0, -2.5, 3.25], [0.0, 0.125, -1e10]], dtype=torch.float32),
        "f64": torch.tensor([math.pi, -math.e], dtype=torch.float64),
        "f16": torch.tensor([1.0, -2.0, 0.5, 65504.0, 2.0**-14, 2.0**-24], dtype=torch.float16),
        "bf16": torch.tensor([1.0, -3.0, 0.15625, 2.0**127 * 1.5, -(2.0**-130)], dtype=torch.bfloat16),
        "i64": torch.tensor([-(2**62), 7, -1], dtype=torch.int64),
        "i32": torch.tensor([[-(2**31), 2**31 - 1], [0, 5]], dtype=torch.int32),
        "i16": torch.tensor([-32768, 32767, 1], dtype=torch.int16),
        "i8": torch.tensor([-128, 127, 0, -1, 3], dtype=torch.int8),
        "u8": torch.tensor([0, 255, 3], dtype=torch.uint8),
        "mask": torch.tensor([True, False, True], dtype=torch.bool),
        "scalar": torch.tensor(42.0, dtype=torch.float32),
        "empty": torch.zeros(0, 3, dtype=torch.float32),
    }
    metadata = {"format": "pt", "source": "make_safetensors_fixtures.py", "note": "h\u00e9llo \u2713"}
    save_file(tensors, os.path.join(out, "dtypes.safetensors"), metadata=metadata)
    expected = {"metadata": metadata, "tensors": {k: describe(v) for k, v in tensors.items()}}
    with open(os.path.join(out, "dtypes.json"), "w") as f:
        json.dump(expected, f, indent=1)

    save_file({}, os.path.join(out, "no_tensors.safetensors"))


def model_fixtures(out: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    # About 29 kB of float32 in 21 tensors: 12 kB shards give several shards, and the
    # 4 kB embedding and lm_head do not sit alone.
    max_shard_bytes = 12_000
    model.save_pretrained(os.path.join(out, "sharded"), max_shard_size=max_shard_bytes)
    model.save_pretrained(os.path.join(out, "single"))

    state = model.state_dict()
    with open(os.path.join(out, "sharded", "model.safetensors.index.json")) as f:
        index = json.load(f)
    expected = {
        "max_shard_bytes": max_shard_bytes,
        "order": list(state.keys()),
        "index": index,
        "tensors": {k: describe(v) for k, v in state.items()},
    }
    with open(os.path.join(out, "model.json"), "w") as f:
        json.dump(expected, f)


def dump(path: str, out_json: str) -> None:
    result = {"tensors": {}, "shard_of": {}}
    if os.path.isdir(path):
        index_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index_path):
            with open(index_path) as f:
                index = json.load(f)
            result["index_metadata"] = index["metadata"]
            files = sorted(set(index["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        paths = [os.path.join(path, name) for name in files]
    else:
        paths = [path]
    for p in paths:
        with safe_open(p, framework="pt") as f:
            result["metadata"] = f.metadata() or {}
            for key in f.keys():
                result["tensors"][key] = describe(f.get_tensor(key))
                result["shard_of"][key] = os.path.basename(p)
    with open(out_json, "w") as f:
        json.dump(result, f)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--dump":
        dump(sys.argv[2], sys.argv[3])
        return
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    dtypes_fixture(out)
    model_fixtures(out)


if __name__ == "__main__":
    main()
