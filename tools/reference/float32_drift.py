#!/usr/bin/env python3
"""How far float32 arithmetic itself drifts from the exact math on one checkpoint, layer by layer.

transformers runs the checkpoint twice on the CPU, in float32 and in float64 (device_check's twin,
its decoder layers streamed so that a float64 E2B fits in a few GB), over the device_check prompt
(ids folded into the checkpoint's vocabulary). Printed: the relative difference of every layer's
hidden states (the last position and the median over positions), the max |dlogit| per position
at a few positions, and, unless --no-engine, our CPU engine's logits (float32, prefilled
--chunk tokens per step) against float64 at the positions where a step ends. float64 is the
oracle: a float32 run, ours or transformers', cannot be expected closer to another float32 run
than both are to float64. See tools/reference/README.md for what this showed on synthetic E2B.

  gemma4 synth --config e2b35.json --format w4a16 --seed 1 -o /tmp/e2b35
  python tools/reference/float32_drift.py --checkpoint /tmp/e2b35 --gemma4 build/gemma4
"""

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

import device_check  # noqa: E402 (beside this script)
from golden import fixed_prompt  # noqa: E402


def prompt(config, length):
    """device_check's prompt with its ids folded into the vocabulary (BOS kept)."""
    ids = fixed_prompt(length or config.sliding_window + 100)
    return ids[:1] + [300 + i % (config.vocab_size - 300) for i in ids[1:]]


@torch.no_grad()
def twin_forward(checkpoint, ids, dtype):
    """transformers' logits and hidden states (embeddings, then after each layer), float64."""
    model, _ = device_check.build_model(checkpoint, "cpu", dtype, stream_layers=True)
    if dtype == torch.float64:  # transformers' default grouped_mm experts take no float64
        model.config._experts_implementation = "eager"
    out = model(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True)
    return (out.logits[0].double().numpy(),
            [h[0].double().numpy() for h in out.hidden_states])


def per_position_max(a, b):
    return np.abs(a - b).max(axis=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--gemma4", default="build/gemma4", help="the gemma4 binary")
    parser.add_argument("--prompt-length", type=int, default=0,
                        help="default: sliding window + 100 (device_check's prompt)")
    parser.add_argument("--chunk", type=int, default=51, help="our engine's prefill step")
    parser.add_argument("--no-engine", action="store_true", help="transformers only")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = device_check.text_config(args.checkpoint)
    ids = prompt(config, args.prompt_length)
    logits32, hidden32 = twin_forward(args.checkpoint, ids, torch.float32)
    logits64, hidden64 = twin_forward(args.checkpoint, ids, torch.float64)

    name = os.path.basename(os.path.normpath(args.checkpoint))
    drift = per_position_max(logits32, logits64)
    print(f"{name}: {len(ids)} positions; transformers float32 vs float64: max |dlogit| "
          f"{drift.max():.4g}, median {np.median(drift):.4g}")
    print("hidden states, |h32 - h64| / |h64| (last position, median over positions):")
    for layer, (h32, h64) in enumerate(zip(hidden32, hidden64)):
        relative = np.linalg.norm(h32 - h64, axis=1) / np.linalg.norm(h64, axis=1)
        # transformers' last hidden state is the final norm's output
        where = ("embeddings" if layer == 0 else f"layer {layer - 1}" +
                 (" + final norm" if layer == len(hidden64) - 1 else ""))
        print(f"  {where:>23}: {relative[-1]:.3g}  {np.median(relative):.3g}")
    shown = sorted({p for p in (0, 1, 10, 50, 100, 200, 400, len(ids) - 1) if p < len(ids)})
    print("max |dlogit| float32 vs float64 at positions " +
          ", ".join(f"{p}: {drift[p]:.3g}" for p in shown))
    if args.no_engine:
        return 0

    with tempfile.TemporaryDirectory() as scratch:
        dump = os.path.join(scratch, "ours.npy")
        command = [args.gemma4, "run", "-m", args.checkpoint, "--device", "cpu", "--prompt-ids",
                   ",".join(map(str, ids)), "-n", "1", "--temperature", "0", "--ignore-eos",
                   "--prompt-chunk", str(args.chunk), "--dump-logits", dump]
        if args.threads:
            command += ["--threads", str(args.threads)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            device_check.fail(f"gemma4 run failed ({result.returncode}): {result.stderr.strip()}")
        ours = np.load(dump).astype(np.float64)
    rows = [min((k + 1) * args.chunk, len(ids)) - 1 for k in range(len(ours))]
    for label, delta in (("our CPU engine vs float64", per_position_max(ours, logits64[rows])),
                         ("our CPU engine vs float32", per_position_max(ours, logits32[rows])),
                         ("transformers float32 vs float64", drift[rows])):
        print(f"{label:32s} at {len(rows)} step ends: max |dlogit| {delta.max():.4g}, "
              f"median {np.median(delta):.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
