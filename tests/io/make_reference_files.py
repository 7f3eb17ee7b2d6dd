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


if __name__ == "__main__":
    main()
