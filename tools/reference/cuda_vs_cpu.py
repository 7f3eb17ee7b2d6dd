#!/usr/bin/env python3
"""Which side of device_check's float32 comparison a logit difference comes from.

device_check.py compares `gemma4 run --device cuda --fp32` with transformers float32 on the GPU:
one number for two devices and two programs. This splits it, on one checkpoint and the
device_check prompt, with our CPU reference engine (float32, an exact oracle: on the CPU it
matches transformers float64 as closely as transformers float32 does) as the common ground:

  cuda decode    gemma4 --device cuda --fp32 --prompt-chunk 1 (what device_check compares)
  cuda prefill   gemma4 --device cuda --fp32 --prompt-chunk C
  cpu engine     gemma4 --device cpu --prompt-chunk C (C-token steps: the CPU engine is slow)
  hf cuda        transformers float32 on the GPU (device_check's twin)
  hf cpu         transformers float32 on the CPU (--twin-devices cuda,cpu)
  hf cuda float64  transformers float64 on the GPU (--twin-devices cuda,cuda:float64): the
                 exact math, up to float64 rounding; how far every float32 run is from it says
                 how much float32 rounding the model itself amplifies

max / median |dlogit| over the positions where a C-token step ends (C - 1, 2C - 1, ..., the
last), for each pair; and cuda decode vs hf cuda over every position (device_check's figure).
Dense checkpoints only: on an MoE one a near-tie router pick can differ between any two of these.

  gemma4 synth --config e2b --format w4a16 --seed 1 -o /tmp/e2b-w4a16
  python tools/reference/cuda_vs_cpu.py --checkpoint /tmp/e2b-w4a16 --gemma4 .devbin/gemma4

Prints one line per pair and writes <name>-cuda-vs-cpu.json to --out.
"""

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

import device_check  # noqa: E402 (beside this script)
import router_trace  # noqa: E402
from golden import fixed_prompt  # noqa: E402


def step_end_positions(steps, chunk, length):
    """The position whose logits each C-token prefill step dumps (its last)."""
    return [min((k + 1) * chunk, length) - 1 for k in range(steps)]


def difference(a, b):
    per_position = np.abs(a.astype(np.float64) - b.astype(np.float64)).max(axis=1)
    return {"max": float(per_position.max()), "median": float(np.median(per_position)),
            "positions": len(per_position)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--gemma4", default=".devbin/gemma4", help="the gemma4 binary")
    parser.add_argument("--device", default="cuda",
                        help="gemma4 --device of the decode and prefill runs (cpu: to try this "
                             "script on a tiny model)")
    parser.add_argument("--chunk", type=int, default=51,
                        help="prefill step of the chunked runs (positions compared)")
    parser.add_argument("--prompt-length", type=int, default=0,
                        help="default: sliding window + 100 (device_check's prompt)")
    parser.add_argument("--twin-devices", default="cuda",
                        help="comma-separated devices to run transformers on, float32 unless "
                             "DEVICE:float64 (cuda, cpu, cuda:float64; empty: none)")
    parser.add_argument("--out", default=os.environ.get("OUT", tempfile.gettempdir()))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    name = os.path.basename(os.path.normpath(args.checkpoint))
    config = device_check.text_config(args.checkpoint)
    if getattr(config, "enable_moe_block", False):
        device_check.fail("MoE checkpoint: router near-ties make the runs incomparable here")
    ids = fixed_prompt(args.prompt_length or config.sliding_window + 100)

    dumps = tempfile.mkdtemp(prefix="cuda_vs_cpu-")
    seconds = {}

    def engine(label, device, chunk, flags):
        started = time.time()
        _, logits, _ = device_check.run_gemma4(
            args.gemma4, args.checkpoint, ids, 1, ["--prompt-chunk", str(chunk), *flags],
            os.path.join(dumps, f"{label.replace(' ', '-')}.npy"), device)
        seconds[label] = time.time() - started
        return logits

    decode = f"{args.device} decode"
    full = {decode: engine(decode, args.device, 1, ["--fp32"])}
    at_steps = {
        f"{args.device} prefill": engine(f"{args.device} prefill", args.device, args.chunk,
                                         ["--fp32"]),
        "cpu engine": engine("cpu engine", "cpu", args.chunk, []),
    }
    shutil.rmtree(dumps)
    positions = step_end_positions(len(at_steps["cpu engine"]), args.chunk, len(ids))
    for twin in filter(None, args.twin_devices.split(",")):
        device, _, dtype = twin.partition(":")
        label = f"hf {device}" + (f" {dtype}" if dtype else "")
        started = time.time()
        model, _ = device_check.build_model(args.checkpoint, device,
                                            getattr(torch, dtype or "float32"))
        if dtype == "float64":  # transformers' default grouped_mm experts take no float64
            model.config._experts_implementation = "eager"
        full[label], _ = router_trace.reference_logits(model, ids, device)
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        seconds[label] = time.time() - started
    for label, logits in full.items():
        at_steps[label] = logits[positions]

    pairs = {f"{a} vs {b}": difference(at_steps[a], at_steps[b])
             for a, b in itertools.combinations(at_steps, 2)}
    if "hf cuda" in full:
        pairs[f"{decode} vs hf cuda, every position"] = difference(full[decode], full["hf cuda"])
    for label, d in pairs.items():
        print(f"{name}: {label:45s} max |dlogit| {d['max']:.4g}  median {d['median']:.4g}  "
              f"({d['positions']} positions)")
    summary = {"checkpoint": args.checkpoint, "prompt_length": len(ids), "chunk": args.chunk,
               "positions": positions, "pairs": pairs, "seconds": seconds,
               "torch": torch.__version__}
    with open(os.path.join(args.out, f"{name}-cuda-vs-cpu.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
