#!/usr/bin/env python3
"""Model-level GPU check: `gemma4 run --device cuda` against transformers (bf16) on one checkpoint.

Runs ON THE GPU MACHINE with a torch + transformers that have CUDA. The transformers twin is built
in GPU memory from the checkpoint itself: packed matrices (compressed-tensors w4g32 or NVFP4,
ModelOpt NVFP4) are dequantized to bf16 in torch, one tensor at a time, and copied into a
Gemma4ForCausalLM built from config.json (bf16, or float32 with --dtype float32 for a tight
check; eager attention) — no bf16 file is written, so the 31B and the 26B-A4B fit the machine's
disk. MoE experts saved per expert (`experts.E.{gate,up,down}_proj`, as quantized checkpoints
do) are copied into transformers' fused `experts.gate_up_proj [E, 2I, H]` (gate rows first) and
`experts.down_proj [E, H, I]` slice by slice; bf16 checkpoints already use the fused names.

The prompt is BOS + fixed ids (the golden fixtures' LCG) longer than the sliding window.
transformers gives 64 greedy tokens (full recompute each step) and the logits at every position
of prompt + greedy[:-1]. gemma4 runs twice:
  teacher-forced  the same ids fed one token per step (--prompt-chunk 1 --dump-logits): our
                  logits at every position of the same sequence -> max |dlogit| per position,
                  top-1 agreement;
  free-running    the prompt prefilled in one step, then 64 greedy tokens -> continuation
                  agreement (and the prefill path's last-position logits).
A top-1 or greedy disagreement is excused only where transformers' top-2 logits are within bf16
rounding of each other (--tie-ulps bf16 ulps of the top logit); each is counted and reported.

  gemma4 synth --config e2b --format w4a16 --seed 1 -o /tmp/e2b-w4a16
  python tools/reference/device_check.py --checkpoint /tmp/e2b-w4a16 --gemma4 .devbin/gemma4
  gemma4 synth --config 26b-a4b --format nvfp4 --seed 1 -o /tmp/26b-nvfp4   # bf16 twin ~52 GB
  python tools/reference/device_check.py --checkpoint /tmp/26b-nvfp4 --gemma4 .devbin/gemma4
On the CPU (--device cpu --torch-device cpu --dtype float32) a tiny model checks the script
itself: tiny-moe nvfp4 / w4a16 / bf16 and tiny w4a16 each pass with max |dlogit| <= 4.9e-5.

Prints one summary line (last) and writes summary.json (and with --save-logits the logits) to
--out. Exit status 0 = PASS, 1 = a mismatch, 2 = the check could not run.
"""

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from safetensors import safe_open
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

# The golden fixtures' prompt (BOS + a fixed LCG over ordinary-text ids); golden.py sits beside
# this script, so it is importable when the script runs.
from golden import fixed_prompt  # noqa: E402

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
# Tensors that carry a packed matrix's side data; each is consumed with its matrix.
SIDE_SUFFIXES = ("weight_scale", "weight_shape", "weight_global_scale", "weight_scale_2",
                 "input_global_scale", "input_scale", "weight_zero_point")


def fail(message):
    """An error of the check itself (exit 2), as opposed to a mismatch (exit 1)."""
    print(f"device_check: {message}", file=sys.stderr)
    sys.exit(2)


def text_config(checkpoint):
    with open(os.path.join(checkpoint, "config.json")) as f:
        config_json = json.load(f)
    text = config_json.get("text_config", config_json)
    dropped = ("architectures", "quantization_config")
    config = Gemma4TextConfig(**{k: v for k, v in text.items() if k not in dropped})
    config._attn_implementation = "eager"
    return config


def nibbles(packed_bytes):
    """[N, B] uint8 -> [N, 2B] codes, even element in the low nibble."""
    low = packed_bytes & 0xF
    high = packed_bytes >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def dequantize(get, module, names, device):
    """The bf16 weight of `module` from its packed tensors, or None if it is not packed."""
    def has(suffix):
        return f"{module}.{suffix}" in names

    if has("weight_packed") and has("weight_global_scale"):  # compressed-tensors NVFP4
        codes = nibbles(get(f"{module}.weight_packed").to(device)).long()
        scale = get(f"{module}.weight_scale").to(device).float()
        block = scale / get(f"{module}.weight_global_scale").to(device).float()
        values = torch.tensor(E2M1, device=device)[codes]
        return (values * block.repeat_interleave(16, dim=1)).to(torch.bfloat16)
    if has("weight_packed"):  # compressed-tensors pack-quantized int4, symmetric
        packed = get(f"{module}.weight_packed").to(device)
        if has("weight_zero_point"):
            fail(f"{module}: asymmetric int4 is not supported here")
        rows, cols = (int(x) for x in get(f"{module}.weight_shape"))
        codes = nibbles(packed.contiguous().view(torch.uint8))[:, :cols].float() - 8
        scale = get(f"{module}.weight_scale").to(device).float()
        group = cols // scale.shape[1]
        return (codes * scale.repeat_interleave(group, dim=1)).to(torch.bfloat16)[:rows]
    if has("weight_scale_2") and has("weight"):  # ModelOpt NVFP4
        codes = nibbles(get(f"{module}.weight").to(device)).long()
        scale = get(f"{module}.weight_scale").to(device).float()
        values = torch.tensor(E2M1, device=device)[codes]
        block = scale * get(f"{module}.weight_scale_2").to(device).float()
        return (values * block.repeat_interleave(16, dim=1)).to(torch.bfloat16)
    return None


# A per-expert matrix of a quantized checkpoint (transformers' name, after hf_name).
EXPERT_SLICE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<which>gate_proj|up_proj|down_proj)\.weight$")


def expert_slice(target, targets):
    """(fused parameter name, view of its slice) for a per-expert matrix, else None."""
    match = EXPERT_SLICE.match(target)
    if match is None:
        return None
    prefix, expert, which = match["prefix"], int(match["expert"]), match["which"]
    if which == "down_proj":
        name = f"{prefix}.down_proj"
        return name, targets[name][expert]
    name = f"{prefix}.gate_up_proj"
    fused = targets[name][expert]
    inner = fused.shape[0] // 2
    return name, fused[:inner] if which == "gate_proj" else fused[inner:]


def hf_name(name):
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name


@torch.no_grad()
def build_model(checkpoint, device, dtype):
    config = text_config(checkpoint)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = Gemma4ForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    targets = model.state_dict(keep_vars=True)
    loaded = set()
    # Fused expert parameters filled slice by slice: how many slices each received.
    expert_slices = {}
    files = sorted(f for f in os.listdir(checkpoint) if f.endswith(".safetensors"))
    # A module's tensors may straddle shards (packed codes in one file, its global scale in the
    # next): every name is looked up in the shard that holds it.
    with contextlib.ExitStack() as stack:
        shards = [stack.enter_context(safe_open(os.path.join(checkpoint, file), framework="pt",
                                                device="cpu")) for file in files]
        owner = {name: shard for shard in shards for name in shard.keys()}
        names = set(owner)

        def get(name):
            return owner[name].get_tensor(name)

        for name in sorted(names):
            module, _, suffix = name.rpartition(".")
            if suffix in SIDE_SUFFIXES:
                continue
            if suffix in ("weight_packed", "weight"):
                tensor = dequantize(get, module, names, device)
                if tensor is not None:
                    name = module + ".weight"
                else:
                    tensor = get(name)
            else:
                tensor = get(name)
            target = hf_name(name)
            if target not in targets:
                sliced = expert_slice(target, targets)
                if sliced is None:
                    continue  # e.g. K/V of KV-shared layers, which transformers does not have
                target, destination = sliced
                expert_slices[target] = expert_slices.get(target, 0) + 1
            else:
                destination = targets[target]
            with torch.no_grad():
                destination.copy_(tensor.to(device).to(destination.dtype).view_as(destination))
            loaded.add(target)
    missing = [k for k in targets if k not in loaded and k != "lm_head.weight"
               and not k.endswith("inv_freq")]
    # gate_up_proj takes two slices per expert (gate, up), down_proj one.
    missing += [k for k, n in expert_slices.items()
                if n != targets[k].shape[0] * (2 if k.endswith("gate_up_proj") else 1)]
    if missing:
        fail(f"checkpoint does not fill Gemma4ForCausalLM: missing {missing[:8]}...")
    model.tie_weights()
    return model, config


@torch.no_grad()
def reference(model, prompt, greedy_tokens, device):
    tokens = list(prompt)
    for _ in range(greedy_tokens):
        logits = model(input_ids=torch.tensor([tokens], device=device), use_cache=False).logits
        tokens.append(int(torch.argmax(logits[0, -1])))
    logits = model(input_ids=torch.tensor([tokens[:-1]], device=device), use_cache=False).logits
    return tokens[len(prompt):], logits[0].float().cpu().numpy()


def run_gemma4(binary, checkpoint, ids, count, extra, dump, device):
    command = [binary, "run", "-m", checkpoint, "--device", device, "--prompt-ids",
               ",".join(map(str, ids)), "-n", str(count), "--temperature", "0", "--ignore-eos",
               "--dump-logits", dump, *extra]
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        fail(f"gemma4 run failed ({result.returncode}): {result.stderr.strip()}")
    generated = [int(x) for x in result.stdout.strip().split(",") if x]
    return generated, np.load(dump), time.time() - started


def bf16_tie(row, ulps):
    """Whether the top-2 logits of `row` are within `ulps` bf16 ulps of the top logit."""
    top2 = np.partition(row, -2)[-2:]
    high, second = float(max(top2)), float(min(top2))
    ulp = 2.0 ** (math.floor(math.log2(max(abs(high), 1e-30))) - 7)
    return high - second <= ulps * ulp, high - second


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--gemma4", default=".devbin/gemma4", help="the gemma4 binary")
    parser.add_argument("--device", default="cuda", help="gemma4 --device")
    parser.add_argument("--gemma4-flag", action="append", default=[],
                        help="extra flag for every `gemma4 run` (repeatable), e.g. --fp32")
    parser.add_argument("--torch-device", default="cuda",
                        help="where transformers runs (cpu: to try this script on a tiny model)")
    parser.add_argument("--prompt-length", type=int, default=0,
                        help="default: sliding window + 100")
    parser.add_argument("--greedy", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="transformers twin's dtype (float32: a tight check that fits for e2b)")
    parser.add_argument("--tie-ulps", type=float, default=2.0)
    parser.add_argument("--out", default=os.environ.get("OUT", tempfile.gettempdir()))
    parser.add_argument("--save-logits", action="store_true",
                        help="also write transformers' and gemma4's logits (.npy, large)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    name = os.path.basename(os.path.normpath(args.checkpoint))

    started = time.time()
    model, config = build_model(args.checkpoint, args.torch_device, getattr(torch, args.dtype))
    load_s = time.time() - started
    prompt = fixed_prompt(args.prompt_length or config.sliding_window + 100)
    assert len(prompt) > config.sliding_window, "the prompt must be longer than the sliding window"
    started = time.time()
    hf_greedy, hf_logits = reference(model, prompt, args.greedy, args.torch_device)
    hf_s = time.time() - started
    del model
    if args.torch_device.startswith("cuda"):
        torch.cuda.empty_cache()

    sequence = prompt + hf_greedy[:-1]
    # The dumps are large (positions x vocabulary floats): kept in --out only with --save-logits.
    dumps = args.out if args.save_logits else tempfile.mkdtemp(prefix="device_check-")
    dump = os.path.join(dumps, f"{name}-gemma4-teacher.npy")
    _, ours, forced_s = run_gemma4(args.gemma4, args.checkpoint, sequence, 1,
                                   ["--prompt-chunk", "1", *args.gemma4_flag], dump,
                                   args.device)
    assert ours.shape == hf_logits.shape, (ours.shape, hf_logits.shape)
    delta = np.abs(ours - hf_logits).max(axis=1)
    hf_top, our_top = hf_logits.argmax(axis=1), ours.argmax(axis=1)
    top1_disagree = [p for p in range(len(sequence)) if hf_top[p] != our_top[p]]
    top1_ties = [p for p in top1_disagree if bf16_tie(hf_logits[p], args.tie_ulps)[0]]

    dump_free = os.path.join(dumps, f"{name}-gemma4-free.npy")
    our_greedy, free_logits, free_s = run_gemma4(args.gemma4, args.checkpoint, prompt,
                                                 args.greedy, args.gemma4_flag, dump_free,
                                                 args.device)
    prefill_delta = float(np.abs(free_logits[0] - hf_logits[len(prompt) - 1]).max())
    agree = next((i for i, (a, b) in enumerate(zip(hf_greedy, our_greedy)) if a != b),
                 len(hf_greedy))
    greedy_tie, greedy_gap = (True, 0.0)
    if agree < len(hf_greedy):
        greedy_tie, greedy_gap = bf16_tie(hf_logits[len(prompt) - 1 + agree], args.tie_ulps)
    if not args.save_logits:
        shutil.rmtree(dumps)
    else:
        np.save(os.path.join(args.out, f"{name}-transformers.npy"), hf_logits)

    passed = len(top1_disagree) == len(top1_ties) and greedy_tie
    summary = {
        "checkpoint": args.checkpoint,
        "positions": len(sequence),
        "prompt_length": len(prompt),
        "sliding_window": config.sliding_window,
        "max_abs_dlogit": float(delta.max()),
        "max_abs_dlogit_position": int(delta.argmax()),
        "median_abs_dlogit": float(np.median(delta)),
        "max_abs_dlogit_per_position": [round(float(d), 5) for d in delta],
        "prefill_last_position_max_abs_dlogit": prefill_delta,
        "top1_disagreements": top1_disagree,
        "top1_disagreements_within_bf16": top1_ties,
        "greedy_tokens": len(hf_greedy),
        "greedy_identical_prefix": agree,
        "greedy_first_divergence_top2_gap": greedy_gap if agree < len(hf_greedy) else None,
        "greedy_divergence_within_bf16": greedy_tie if agree < len(hf_greedy) else None,
        "tie_ulps": args.tie_ulps,
        "transformers_dtype": args.dtype,
        "seconds": {"transformers_load": load_s, "transformers": hf_s,
                    "gemma4_teacher_forced": forced_s, "gemma4_free": free_s},
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if args.torch_device.startswith("cuda") else None,
        "pass": passed,
    }
    with open(os.path.join(args.out, f"{name}-device-check.json"), "w") as f:
        json.dump(summary, f, indent=1)
    greedy_text = (f"greedy {agree}/{len(hf_greedy)} identical" if agree == len(hf_greedy) else
                   f"greedy identical for {agree}/{len(hf_greedy)}, then a "
                   f"{'bf16 near-tie (gap ' if greedy_tie else 'REAL divergence (gap '}"
                   f"{greedy_gap:.3g})")
    print(f"device_check {name} vs transformers {args.dtype}: {len(sequence)} positions, max|dlogit| {delta.max():.4g} "
          f"(pos {int(delta.argmax())}, median {np.median(delta):.3g}, prefill {prefill_delta:.3g}), "
          f"top-1 {len(sequence) - len(top1_disagree)}/{len(sequence)} "
          f"({len(top1_ties)} of {len(top1_disagree)} disagreements within bf16), {greedy_text}; "
          f"load {load_s:.0f}s hf {hf_s:.0f}s ours {forced_s + free_s:.0f}s: "
          f"{'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
