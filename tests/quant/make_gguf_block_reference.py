#!/usr/bin/env python3
"""Writes tests/quant/data/gguf_blocks.gguf: random raw blocks of every GGUF type gemma4 decodes
and repacks, each beside gguf-py's reference dequantization (`<name>.expected`, F32). Run with
the reference venv; the output is committed, so CI does not need Python for it.

    /opt/refenv/bin/python tests/quant/make_gguf_block_reference.py
"""
import os

import gguf
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
Q = gguf.GGMLQuantizationType

# (name, type, rows, cols, byte offsets of the fp16 scale fields within a block)
CASES = [
    ("q4_0", Q.Q4_0, 3, 64, [0]),
    ("q4_1", Q.Q4_1, 3, 64, [0, 2]),
    ("q5_0", Q.Q5_0, 3, 64, [0]),
    ("q8_0", Q.Q8_0, 3, 64, [0]),
    ("iq4_nl", Q.IQ4_NL, 3, 64, [0]),
    ("q4_k", Q.Q4_K, 3, 512, [0, 2]),
    ("q6_k", Q.Q6_K, 3, 512, [208]),
    ("q5_1", Q.Q5_1, 3, 64, [0, 2]),
    ("q5_k", Q.Q5_K, 3, 512, [0, 2]),
]


def random_blocks(rng, qtype, rows, cols, scale_offsets):
    """Random raw blocks with fp16 scales of either sign in [2^-10, 2^-2]."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        magnitude = 2.0 ** rng.uniform(-10, -2, size=raw.shape[:2])
        sign = rng.choice([-1.0, 1.0], size=raw.shape[:2])
        d = (magnitude * sign).astype(np.float16)
        raw[:, :, offset:offset + 2] = d.view(np.uint8).reshape(rows, -1, 2)
    raw = raw.reshape(rows, -1)
    expected = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    return raw, expected


def main():
    rng = np.random.default_rng(6)
    os.makedirs(os.path.join(HERE, "data"), exist_ok=True)
    writer = gguf.GGUFWriter(os.path.join(HERE, "data", "gguf_blocks.gguf"), "gemma4")
    for name, qtype, rows, cols, offsets in CASES:
        raw, expected = random_blocks(rng, qtype, rows, cols, offsets)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        writer.add_tensor(name + ".expected", expected)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
