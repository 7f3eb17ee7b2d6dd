"""HF `tokenizers` on the same inputs as bench/tokenizer_bench.cpp, single-threaded.

Times are process CPU seconds (best of several runs), comparable with Google Benchmark's CPU
column on a shared machine. "cold" is the first encode on a freshly loaded tokenizer (empty
word cache).

Usage: GEMMA4_SHARED_DATA=../shared/data RAYON_NUM_THREADS=1 python bench/tokenizer_hf_bench.py
"""

import os
import time
from pathlib import Path

from tokenizers import Tokenizer

SHARED = Path(os.environ["GEMMA4_SHARED_DATA"])
SPEC = SHARED / ".." / "spec"
CORPORA = {
    "prose": b"".join((SPEC / name).read_bytes() for name in (
        "gemma4-architecture.md", "gemma4-chat-format.md", "weight-formats.md",
        "h200-decode-notes.md")).decode("utf-8"),
    "json": (SPEC / "gemma4-chat-vectors.json").read_bytes().decode("utf-8"),
}


def best_seconds(function, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        function()
        best = min(best, time.process_time() - start)
    return best


def main():
    path = str(SHARED / "tokenizer" / "tokenizer.json")
    load = best_seconds(lambda: Tokenizer.from_file(path), 3)
    print(f"load tokenizer.json: {load * 1000:.0f} ms")
    for name, text in CORPORA.items():
        size_mb = len(text.encode("utf-8")) / 1e6
        tok = Tokenizer.from_file(path)
        cold = best_seconds(lambda: tok.encode(text, add_special_tokens=False), 1)
        whole = best_seconds(lambda: tok.encode(text, add_special_tokens=False), 5)
        lines = text.split("\n")
        per_line = best_seconds(
            lambda: [tok.encode(line, add_special_tokens=False) for line in lines], 5)
        print(f"{name}: {size_mb * 1e3:.0f} kB, {len(lines)} lines; encode whole "
              f"{size_mb / whole:.2f} MB/s (cold {size_mb / cold:.2f} MB/s), "
              f"per line {size_mb / per_line:.2f} MB/s")


if __name__ == "__main__":
    main()
