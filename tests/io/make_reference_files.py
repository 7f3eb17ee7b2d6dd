#!/usr/bin/env python3
"""Writes the small safetensors files the io tests and the fuzz seeds use, with the reference
(Rust) writer of the `safetensors` package. Run with the reference venv; the outputs are
committed, so CI does not need Python for them.

    /opt/refenv/bin/python tests/io/make_reference_files.py
"""
import os
import json

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SEEDS = os.path.join(ROOT, "fuzz", "seeds", "safetensors_header")


def reference_tensors():
    # Values the C++ test recomputes from these formulas.
    return {
        "a.f32": torch.arange(6, dtype=torch.float32).reshape(2, 3) * 0.5,  # 0, .5, 1, ...
        "b.bf16": (torch.arange(4, dtype=torch.float32) - 1.5).to(torch.bfloat16),
        "c.i64": torch.tensor([7, -3], dtype=torch.int64),
        "d.u8": torch.arange(5, dtype=torch.uint8),
        "e.scalar": torch.tensor(2.25, dtype=torch.float32),
        "f.e4m3": torch.tensor([1.0, -0.5, 448.0], dtype=torch.float32).to(torch.float8_e4m3fn),
        "g.empty": torch.zeros((0, 4), dtype=torch.float16),
        "h.i32": torch.tensor([[1, -1], [2**31 - 1, -(2**31)]], dtype=torch.int32),
    }


def main():
    os.makedirs(os.path.join(HERE, "data"), exist_ok=True)
    os.makedirs(SEEDS, exist_ok=True)
    save_file(reference_tensors(), os.path.join(HERE, "data", "reference.safetensors"),
              metadata={"format": "pt"})
    save_file(reference_tensors(), os.path.join(SEEDS, "reference.safetensors"),
              metadata={"format": "pt"})
    save_file({"w": torch.ones(2, 2, dtype=torch.bfloat16)}, os.path.join(SEEDS, "one.safetensors"))
    save_file({}, os.path.join(SEEDS, "empty.safetensors"))
    # A hand-built file with a padded header and a packed-int4 triple as compressed-tensors
    # writes it.
    header = {
        "m.weight_packed": {"dtype": "I32", "shape": [1, 4], "data_offsets": [0, 16]},
        "m.weight_scale": {"dtype": "BF16", "shape": [1, 1], "data_offsets": [16, 18]},
        "m.weight_shape": {"dtype": "I64", "shape": [2], "data_offsets": [18, 34]},
        "__metadata__": {"format": "pt"},
    }
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(os.path.join(SEEDS, "compressed.safetensors"), "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + bytes(34))



# --- GGUF -------------------------------------------------------------------------------------

GGUF_SEEDS = os.path.join(ROOT, "fuzz", "seeds", "gguf")


def random_blocks(rng, qtype, rows, cols):
    """Random raw blocks of `qtype` with sane fp16 scales; the dequantized values come from
    gguf-py's reference implementation and are stored beside them."""
    import numpy as np
    import gguf

    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    # fp16 d (and dmin) in [2^-8, 2^-4]: overwrite the fields the spec places at 0 (and 2).
    scale_fields = {gguf.GGMLQuantizationType.Q4_0: [0], gguf.GGMLQuantizationType.Q8_0: [0],
                    gguf.GGMLQuantizationType.Q4_K: [0, 2]}[qtype]
    for offset in scale_fields:
        d = rng.uniform(2.0**-8, 2.0**-4, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, offset:offset + 2] = d.view(np.uint8).reshape(rows, -1, 2)
    raw = raw.reshape(rows, -1)
    expected = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    return raw, expected


def write_gguf_files():
    import numpy as np
    import gguf

    os.makedirs(GGUF_SEEDS, exist_ok=True)
    rng = np.random.default_rng(4)
    path = os.path.join(HERE, "data", "reference.gguf")
    writer = gguf.GGUFWriter(path, "gemma4")
    writer.add_uint8("test.u8", 200)
    writer.add_int8("test.i8", -100)
    writer.add_uint16("test.u16", 60000)
    writer.add_int16("test.i16", -30000)
    writer.add_uint32("test.u32", 4000000000)
    writer.add_int32("test.i32", -2000000000)
    writer.add_float32("test.f32", 0.5)
    writer.add_bool("test.bool", True)
    writer.add_uint64("test.u64", 2**63 + 5)
    writer.add_int64("test.i64", -(2**40))
    writer.add_float64("test.f64", -2.25)
    writer.add_string("test.string", "héllo")
    writer.add_array("test.strings", ["a", "", "▁b"])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.25, -1.5])
    writer.add_array("test.bools", [True, False, True])
    writer.add_tensor("plain.f32", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.add_tensor("plain.f16", np.array([[1.5, -2.0]], dtype=np.float16))
    for name, qtype, rows, cols in [("q4_0", gguf.GGMLQuantizationType.Q4_0, 2, 64),
                                    ("q8_0", gguf.GGMLQuantizationType.Q8_0, 1, 32),
                                    ("q4_k", gguf.GGMLQuantizationType.Q4_K, 2, 256)]:
        raw, expected = random_blocks(rng, qtype, rows, cols)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        writer.add_tensor(name + ".expected", expected)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    seed = gguf.GGUFWriter(os.path.join(GGUF_SEEDS, "small.gguf"), "gemma4")
    seed.add_uint32("general.alignment", 64)
    seed.add_array("tokenizer.ggml.tokens", ["<pad>", "a"])
    seed.add_tensor("t", np.ones((2, 2), dtype=np.float32))
    seed.write_header_to_file()
    seed.write_kv_data_to_file()
    seed.write_tensors_to_file()
    seed.close()


if __name__ == "__main__":
    main()
    write_gguf_files()
