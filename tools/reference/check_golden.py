#!/usr/bin/env python3
"""Checks `gemma4 run` on a real model against a committed transformers fixture.

The fixture (tools/reference/gguf_golden.py writes it, e.g. tests/data/golden/gemma3-270m.json)
holds, per prompt: the prompt ids, the 64 largest last-position logits, the logits of 256 fixed
ids, and 64 greedy tokens. This runs our binary on any device (`--device cuda` on the GPU
machine: the CPU engine is checked by tests/model in CI), compares, and prints one JSON summary.

  check_golden.py --bin gemma4 --model FILE.gguf --golden FIXTURE.json [--device cuda]
                  [--tolerance 1e-3] [--gemma4-flag=--fp32] [--out result.json]

Exit status 0 when every case is within tolerance and every greedy token matches. Needs only
the standard library plus numpy (to read the .npy the binary dumps).
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def run_case(args, case, workdir, index):
    dump = Path(workdir) / f"case{index}.npy"
    greedy_count = len(case["greedy"])
    command = [
        args.bin, "run", "-m", args.model, "--device", args.device,
        "--prompt-ids", ",".join(str(i) for i in case["ids"]),
        "-n", str(greedy_count), "--temperature", "0", "--ignore-eos",
        "--dump-logits", str(dump), *args.gemma4_flag,
    ]
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{completed.stderr}")
    generated = [int(t) for t in completed.stdout.strip().split(",") if t]
    logits = np.load(dump)
    first = logits[0]
    deltas = [abs(float(first[i]) - v) for i, v in case["top"] + case["sampled"]]
    our_top = int(np.argmax(first))
    return {
        "text": case["text"][:40],
        "max_abs_delta": max(deltas),
        "top1_equal": our_top == case["top"][0][0],
        "greedy_equal": sum(1 for a, b in zip(generated, case["greedy"]) if a == b),
        "greedy_first_mismatch": next(
            (i for i, (a, b) in enumerate(zip(generated, case["greedy"])) if a != b), None),
        "greedy_count": greedy_count,
        "generated": len(generated),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--golden", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--gemma4-flag", action="append", default=[],
                        help="extra flag for `gemma4 run` (repeatable), e.g. --fp32")
    parser.add_argument("--out")
    args = parser.parse_args()

    fixture = json.loads(Path(args.golden).read_text())
    with tempfile.TemporaryDirectory() as workdir:
        cases = [run_case(args, case, workdir, i) for i, case in enumerate(fixture["cases"])]
    passed = all(c["max_abs_delta"] <= args.tolerance and c["greedy_equal"] == c["greedy_count"]
                 and c["generated"] == c["greedy_count"] for c in cases)
    summary = {"model": fixture["model"], "reference": fixture["reference"],
               "device": args.device, "tolerance": args.tolerance, "passed": passed,
               "cases": cases}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
