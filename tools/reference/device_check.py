#!/usr/bin/env python3
"""Model-level GPU check: `gemma4 run --device cuda` against transformers (bf16) on one checkpoint.

Runs ON THE GPU MACHINE with a torch + transformers that have CUDA. The transformers twin is built
in GPU memory from the checkpoint itself: packed matrices (compressed-tensors w4g32 or NVFP4,
ModelOpt NVFP4) are dequantized exactly (float32) in torch, one tensor at a time, and copied into a
Gemma4ForCausalLM built from config.json (bf16, or float32 with --dtype float32 for a tight
check; eager attention) — no bf16 file is written, so the 31B and the 26B-A4B fit the machine's
disk. MoE experts saved per expert (`experts.E.{gate,up,down}_proj`, as quantized checkpoints
do) are copied into transformers' fused `experts.gate_up_proj [E, 2I, H]` (gate rows first) and
`experts.down_proj [E, H, I]` slice by slice; bf16 checkpoints already use the fused names.
A twin that would take more than 3/4 of the free GPU memory (the 31B in float32: 122.8 GB of
weights; the 26B-A4B's 100.9 GB still fits) is streamed instead (--stream-layers, LayerStreamer):
built on the meta device with only embeddings, norms, RoPE and the tied lm_head resident, each
decoder layer is dequantized onto the GPU by a forward pre-hook and sent back to the meta device
by a forward hook, so a forward holds one layer at a time (and reads the packed file again).

The prompt is BOS + fixed ids (the golden fixtures' LCG) longer than the sliding window. gemma4
runs first:
  free-running    the prompt prefilled in one step, then 64 greedy tokens (logits of every step);
  teacher-forced  prompt + those tokens[:-1] fed one token per step (--prompt-chunk 1
                  --dump-logits): our logits at every position of that sequence.
transformers then gives its logits at every position of the same sequence in one forward:
max |dlogit| per position and top-1 agreement against the teacher-forced run; the greedy tokens
must each be transformers' argmax at their step (greedy_identical_prefix counts how many are
before the first that is not), and the free-running logits are compared at their positions.
A top-1 or greedy disagreement is excused only where transformers' top-2 logits are within bf16
rounding of each other (--tie-ulps bf16 ulps of the top logit); each is counted and reported.

MoE checkpoints: both gemma4 runs also write --router-trace (and the teacher-forced run is
repeated without it, with graphs: graphs_vs_traced must be ~0). A top-k router pick decided
differently by a near-tie (router_trace.py: the margin in transformers' logits within --tie-ulps
bf16 ulps) sends the two sides through different experts, and from there every later position
differs, by much more than rounding: that is not a kernel error, and comparing past it tests
nothing. So transformers runs once unforced (the first flips and their margins are printed, the
unforced max |dlogit| reported) and once per gemma4 run FORCED to our picks at every near-tie
flip (decided in its own logits, layer by layer, so forced flips' consequences are what it sees
next); the logits checks above use the forced runs. A flip by more than a near-tie is never
forced and fails the check.

  gemma4 synth --config e2b --format w4a16 --seed 1 -o /tmp/e2b-w4a16
  python tools/reference/device_check.py --checkpoint /tmp/e2b-w4a16 --gemma4 .devbin/gemma4
  gemma4 synth --config 26b-a4b --format nvfp4 --seed 1 -o /tmp/26b-nvfp4   # bf16 twin ~52 GB
  python tools/reference/device_check.py --checkpoint /tmp/26b-nvfp4 --gemma4 .devbin/gemma4
  gemma4 synth --config 31b --format w4a16 --seed 1 -o /tmp/31b   # float32 twin streamed
  python tools/reference/device_check.py --checkpoint /tmp/31b --gemma4 .devbin/gemma4 \
      --dtype float32 --gemma4-flag=--fp32
On the CPU (--device cpu --torch-device cpu --dtype float32) a tiny model checks the script
itself: tiny-moe nvfp4 / w4a16 / bf16 and tiny w4a16 each pass with max |dlogit| <= 4.9e-5, and
the streamed twin's logits equal the resident one's bit for bit (tests/reference).

Prints one summary line (last) and writes summary.json (and with --save-logits the logits) to
--out. Exit status 0 = PASS, 1 = a mismatch, 2 = the check could not run.
"""

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

import numpy as np
import torch
from safetensors import safe_open
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

# The golden fixtures' prompt (BOS + a fixed LCG over ordinary-text ids); golden.py sits beside
# this script, so it is importable when the script runs.
from golden import fixed_prompt  # noqa: E402
import router_trace  # noqa: E402

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


def packed_format(module, names):
    """How `module`'s matrix is packed in a checkpoint holding `names`, or None if it is not."""
    def has(suffix):
        return f"{module}.{suffix}" in names

    if has("weight_packed"):  # compressed-tensors: NVFP4 has a global scale, int4 has not
        return "nvfp4" if has("weight_global_scale") else "int4"
    if has("weight_scale_2") and has("weight"):
        return "modelopt-nvfp4"
    return None


def dequantize(get, module, packing, device):
    """The float32 weight of `module` from its packed tensors (`packing`: packed_format's).

    Exact: a 4-bit code times its bf16/e4m3 scale has at most 12 significant bits. Rounding it to
    bf16 here (as this did before) made the float32 twin of a W4A16 checkpoint differ from the
    checkpoint's own math by up to a bf16 ulp per weight; the bf16 twin rounds once, at the copy."""
    if packing == "nvfp4":
        codes = nibbles(get(f"{module}.weight_packed").to(device)).long()
        scale = get(f"{module}.weight_scale").to(device).float()
        block = scale / get(f"{module}.weight_global_scale").to(device).float()
        values = torch.tensor(E2M1, device=device)[codes]
        return values * block.repeat_interleave(16, dim=1)
    if packing == "int4":  # pack-quantized, symmetric
        packed = get(f"{module}.weight_packed").to(device)
        rows, cols = (int(x) for x in get(f"{module}.weight_shape"))
        codes = nibbles(packed.contiguous().view(torch.uint8))[:, :cols].float() - 8
        scale = get(f"{module}.weight_scale").to(device).float()
        group = cols // scale.shape[1]
        return (codes * scale.repeat_interleave(group, dim=1))[:rows]
    codes = nibbles(get(f"{module}.weight").to(device)).long()  # ModelOpt NVFP4
    scale = get(f"{module}.weight_scale").to(device).float()
    values = torch.tensor(E2M1, device=device)[codes]
    block = scale * get(f"{module}.weight_scale_2").to(device).float()
    return values * block.repeat_interleave(16, dim=1)


# A per-expert matrix of a quantized checkpoint (transformers' name, after hf_name).
EXPERT_SLICE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<which>gate_proj|up_proj|down_proj)\.weight$")
# A decoder layer's tensor (transformers' name): the layer's index and the name inside the layer.
LAYER_TENSOR = re.compile(r"^model\.layers\.(?P<index>\d+)\.(?P<inner>.+)$")


def hf_name(name):
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name


@dataclasses.dataclass(frozen=True)
class Source:
    """One checkpoint tensor and the transformers tensor it fills."""
    name: str             # in the checkpoint: a plain tensor, or a packed matrix's codes
    packing: str | None   # packed_format of its module (None: copied as it is)
    target: str           # transformers' parameter or buffer
    expert: int | None = None  # a per-expert matrix: its expert's slice of the fused target
    which: str | None = None   # and which of gate_proj / up_proj / down_proj it is


class Checkpoint:
    """A checkpoint's safetensors shards, read on demand. A module's tensors may straddle shards
    (packed codes in one file, its global scale in the next): every name is read from the shard
    that holds it."""

    def __init__(self, directory):
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        shards = [safe_open(os.path.join(directory, file), framework="pt", device="cpu")
                  for file in files]
        self._owner = {name: shard for shard in shards for name in shard.keys()}
        self.names = set(self._owner)

    def get(self, name):
        return self._owner[name].get_tensor(name)

    def plan(self, targets):
        """The Source of every tensor transformers takes from the checkpoint (`targets`: its
        state-dict names). MoE experts saved per expert (`experts.E.{gate,up,down}_proj`, as
        quantized checkpoints do) fill slices of transformers' fused `experts.gate_up_proj
        [E, 2I, H]` (gate rows first) and `experts.down_proj [E, H, I]`; tensors transformers has
        no place for (the K/V of KV-shared layers) are left out."""
        sources = []
        for name in sorted(self.names):
            module, _, suffix = name.rpartition(".")
            if suffix in SIDE_SUFFIXES:
                continue
            packing = (packed_format(module, self.names)
                       if suffix in ("weight_packed", "weight") else None)
            if packing == "int4" and f"{module}.weight_zero_point" in self.names:
                fail(f"{module}: asymmetric int4 is not supported here")
            target = hf_name(module + ".weight" if packing else name)
            if target in targets:
                sources.append(Source(name, packing, target))
                continue
            match = EXPERT_SLICE.match(target)
            if match is not None:
                fused = "down_proj" if match["which"] == "down_proj" else "gate_up_proj"
                sources.append(Source(name, packing, f"{match['prefix']}.{fused}",
                                      int(match["expert"]), match["which"]))
        return sources

    def tensor(self, source, device):
        if source.packing is None:
            return self.get(source.name)
        return dequantize(self.get, source.name.rpartition(".")[0], source.packing, device)


def unfilled(sources, targets):
    """transformers' tensors that `sources` leave empty or, for fused experts, partly filled."""
    counts = Counter(source.target for source in sources)
    missing = [k for k in targets if k not in counts and k != "lm_head.weight"
               and not k.endswith("inv_freq")]
    # gate_up_proj takes two slices per expert (gate, up), down_proj one.
    fused = {source.target for source in sources if source.expert is not None}
    missing += [k for k in fused
                if counts[k] != targets[k].shape[0] * (2 if k.endswith("gate_up_proj") else 1)]
    return missing


@torch.no_grad()
def fill(checkpoint, sources, tensors, device):
    """Copies every source into its tensor among `tensors` (name -> parameter or buffer)."""
    for source in sources:
        destination = tensors[source.target]
        if source.expert is not None:
            destination = destination[source.expert]
            if source.which != "down_proj":
                inner = destination.shape[0] // 2
                destination = destination[:inner] if source.which == "gate_proj" else destination[inner:]
        tensor = checkpoint.tensor(source, device)
        destination.copy_(tensor.to(device).to(destination.dtype).view_as(destination))


def new_model(config, device, dtype):
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Gemma4ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def twin_bytes(config, dtype):
    """What the transformers twin's weights take (a tied lm_head counted once)."""
    skeleton = new_model(config, "meta", dtype)
    return sum(p.numel() * p.element_size() for p in skeleton.parameters())


@torch.no_grad()
def materialize(model, modules, device):
    """Gives `modules` (of `model`, on the meta device) uninitialised storage on `device`, and
    their non-persistent buffers (RoPE inverse frequencies, embedding scales: not in the
    checkpoint) their values from transformers' own initialisation, as its meta-device loading
    does. Those buffers are NaN before it: one it leaves unset stops the check."""
    for module in modules:
        module.to_empty(device=device, recurse=False)
        computed = [(name, module.get_buffer(name)) for name in module._non_persistent_buffers_set
                    if module.get_buffer(name) is not None]
        if not computed:
            continue
        for _, buffer in computed:
            if buffer.is_floating_point():
                buffer.fill_(math.nan)
        model._init_weights(module)
        unset = [name for name, buffer in computed if buffer.isnan().any()]
        if unset:
            fail(f"transformers' _init_weights left {type(module).__name__}.{unset} unset: "
                 "this transformers cannot build the streamed twin (try --stream-layers never)")


class LayerStreamer:
    """Decoder layers that hold weights on the device only while they run. The model is built on
    the meta device; everything but the decoder layers (embeddings, final norm, RoPE, a tied
    lm_head) is made resident, and each decoder layer gets a forward pre-hook that materializes
    it from the checkpoint (dequantized on the device, as the resident build does) and a forward
    hook that sends it back to the meta device, freeing its memory. A forward then holds one
    layer at a time, and every forward reads the layers again."""

    def __init__(self, model, checkpoint, sources, device):
        self.model, self.checkpoint, self.device = model, checkpoint, device
        self.layer_sources = [[] for _ in model.model.layers]
        resident = []
        for source in sources:
            match = LAYER_TENSOR.match(source.target)
            if match is None:
                resident.append(source)
            else:
                self.layer_sources[int(match["index"])].append(
                    dataclasses.replace(source, target=match["inner"]))
        in_layers = {id(m) for m in model.model.layers.modules()}
        materialize(model, [m for m in model.modules() if id(m) not in in_layers], device)
        fill(checkpoint, resident, model.state_dict(keep_vars=True), device)
        for index, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(self._loader(index))
            layer.register_forward_hook(self._release)

    def _loader(self, index):
        def load(layer, args):
            materialize(self.model, layer.modules(), self.device)
            fill(self.checkpoint, self.layer_sources[index], layer.state_dict(keep_vars=True),
                 self.device)
        return load

    @staticmethod
    def _release(layer, args, output):
        layer.to("meta")


@torch.no_grad()
def build_model(directory, device, dtype, stream_layers=False):
    """transformers' twin of the checkpoint in `dtype` on `device`: resident, or with
    `stream_layers` its decoder layers streamed from the checkpoint (LayerStreamer)."""
    config = text_config(directory)
    checkpoint = Checkpoint(directory)
    skeleton = new_model(config, "meta", dtype)
    targets = skeleton.state_dict(keep_vars=True)
    sources = checkpoint.plan(targets)
    missing = unfilled(sources, targets)
    if missing:
        fail(f"checkpoint does not fill Gemma4ForCausalLM: missing {missing[:8]}...")
    if stream_layers:
        model = skeleton
        LayerStreamer(model, checkpoint, sources, device)
    else:
        del skeleton, targets
        model = new_model(config, device, dtype)
        fill(checkpoint, sources, model.state_dict(keep_vars=True), device)
    model.tie_weights()
    return model, config


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


def teacher_forced_check(hf_logits, ours, tie_ulps):
    """Max |dlogit| per position and the top-1 disagreements (all, and those within bf16)."""
    delta = np.abs(ours - hf_logits).max(axis=1)
    hf_top, our_top = hf_logits.argmax(axis=1), ours.argmax(axis=1)
    disagree = [p for p in range(len(delta)) if hf_top[p] != our_top[p]]
    ties = [p for p in disagree if bf16_tie(hf_logits[p], tie_ulps)[0]]
    return delta, disagree, ties


def greedy_check(hf_logits, prompt_length, greedy, tie_ulps):
    """How many of our greedy tokens transformers' argmax reproduces before the first that it
    does not, and that step's (within bf16, top-2 gap), or None when all agree. hf_logits covers
    prompt + greedy[:-1]: row prompt_length - 1 + i predicts greedy[i]."""
    for i, token in enumerate(greedy):
        row = hf_logits[prompt_length - 1 + i]
        if int(row.argmax()) != token:
            return i, bf16_tie(row, tie_ulps)
    return len(greedy), None


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
                        help="transformers twin's dtype (float32: the tight check)")
    parser.add_argument("--stream-layers", default="auto", choices=("auto", "always", "never"),
                        help="build the twin's decoder layers one at a time during each forward "
                             "(LayerStreamer) instead of all at once; auto: when the whole twin "
                             "would take more than 3/4 of the free GPU memory (the 31B in float32)")
    parser.add_argument("--tie-ulps", type=float, default=2.0)
    parser.add_argument("--router-tie-ulps", type=float, default=2.0,
                        help="MoE: a router flip is a near-tie within this many bf16 ulps of the "
                             "row's largest |logit| (a bf16 twin's own rounding needs ~8)")
    parser.add_argument("--out", default=os.environ.get("OUT", tempfile.gettempdir()))
    parser.add_argument("--save-logits", action="store_true",
                        help="also write transformers' and gemma4's logits (.npy, large)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    name = os.path.basename(os.path.normpath(args.checkpoint))
    config = text_config(args.checkpoint)
    moe = bool(getattr(config, "enable_moe_block", False))
    prompt = fixed_prompt(args.prompt_length or config.sliding_window + 100)
    assert len(prompt) > config.sliding_window, "the prompt must be longer than the sliding window"

    # gemma4 first (free-running, then teacher-forced over its own continuation), so the
    # transformers twin gets the GPU to itself afterwards.
    dumps = args.out if args.save_logits else tempfile.mkdtemp(prefix="device_check-")
    dump = lambda kind: os.path.join(dumps, f"{name}-gemma4-{kind}.npy")  # noqa: E731
    trace_flags = lambda kind: (["--router-trace", dump(kind + "-router")]  # noqa: E731
                                if moe else [])
    our_greedy, free_logits, free_s = run_gemma4(
        args.gemma4, args.checkpoint, prompt, args.greedy, [*args.gemma4_flag, *trace_flags("free")],
        dump("free"), args.device)
    sequence = prompt + our_greedy[:-1]
    _, ours, forced_s = run_gemma4(args.gemma4, args.checkpoint, sequence, 1,
                                   ["--prompt-chunk", "1", *args.gemma4_flag], dump("teacher"),
                                   args.device)
    graphs_vs_traced = None
    if moe:
        # The trace downloads after every layer, so those runs decode without graphs: the
        # teacher-forced run above (graphs) must compute the same as its traced twin.
        _, traced, traced_s = run_gemma4(
            args.gemma4, args.checkpoint, sequence, 1,
            ["--prompt-chunk", "1", *args.gemma4_flag, *trace_flags("teacher")],
            dump("teacher-traced"), args.device)
        forced_s += traced_s
        graphs_vs_traced = float(np.abs(ours - traced).max())

    dtype = getattr(torch, args.dtype)
    weight_bytes = twin_bytes(config, dtype)
    streamed = args.stream_layers == "always" or (
        args.stream_layers == "auto" and args.torch_device.startswith("cuda") and
        weight_bytes > 0.75 * torch.cuda.mem_get_info(torch.device(args.torch_device))[0])
    started = time.time()
    model, config = build_model(args.checkpoint, args.torch_device, dtype, streamed)
    load_s = time.time() - started
    started = time.time()
    hf_logits, plain = router_trace.reference_logits(model, sequence, args.torch_device)
    assert ours.shape == hf_logits.shape, (ours.shape, hf_logits.shape)
    router = {}
    hf_free = hf_logits
    if moe:
        # Router picks that differ by a near-tie (router_trace.py) send the two sides through
        # different experts from there on: every later position drifts, which says nothing about
        # the kernels. So transformers is run again, forced to our picks at such flips (found in
        # its own logits of that run, layer by layer), once per gemma4 run; a flip by more than a
        # near-tie is left alone and fails the check.
        layers, experts, top_k = config.num_hidden_layers, config.num_experts, config.top_k_experts
        ours_teacher = router_trace.load(dump("teacher-router"), layers, len(sequence), experts,
                                         top_k)
        ours_free = router_trace.load(dump("free-router"), layers, len(sequence), experts, top_k)
        flips, agree_delta = router_trace.compare(ours_teacher, plain.trace,
                                                  args.router_tie_ulps)
        for line in router_trace.report(flips, agree_delta, plain.trace,
                                         "router, teacher-forced, transformers unforced"):
            print(line)
        hf_unforced = hf_logits
        hf_logits, forced_teacher = router_trace.reference_logits(
            model, sequence, args.torch_device, ours_teacher, args.router_tie_ulps)
        hf_free, forced_free = router_trace.reference_logits(
            model, sequence, args.torch_device, ours_free, args.router_tie_ulps)
        unforced_delta, unforced_disagree, _ = teacher_forced_check(hf_unforced, ours,
                                                                    args.tie_ulps)
        first = router_trace.first_flips(flips)
        router = {
            "unforced_flips": len(flips),
            "unforced_near_ties": sum(f.tie for f in flips),
            "unforced_first_flip": (
                {"layer": first[0].layer, "position": first[0].position, "gap": first[0].gap,
                 "our_gap": first[0].our_gap, "row_max_abs_dlogit": first[0].delta,
                 "near_tie": first[0].tie} if first else None),
            "unforced_max_abs_dlogit": float(unforced_delta.max()),
            "unforced_top1_disagreements": len(unforced_disagree),
            "router_max_abs_dlogit_where_picks_agree": agree_delta,
            "forced_near_ties_teacher": [(f.layer, f.position, f.gap) for f in
                                         forced_teacher.forced],
            "forced_near_ties_free": [(f.layer, f.position, f.gap) for f in forced_free.forced],
            "real_flips_teacher": [(f.layer, f.position, f.gap) for f in forced_teacher.unforced],
            "real_flips_free": [(f.layer, f.position, f.gap) for f in forced_free.unforced],
            "graphs_vs_traced_max_abs_dlogit": graphs_vs_traced,
        }
        for kind, forcing in (("teacher-forced", forced_teacher), ("free-running", forced_free)):
            print(f"router, {kind}: transformers forced to our picks at {len(forcing.forced)} "
                  f"near-ties, {len(forcing.unforced)} real flips left")
            for f in (forcing.unforced + forcing.forced)[:4]:
                print("  " + f.describe(forcing.trace.logits[f.layer, f.position]))
    hf_s = time.time() - started
    del model

    delta, top1_disagree, top1_ties = teacher_forced_check(hf_logits, ours, args.tie_ulps)
    prefill_delta = float(np.abs(free_logits[0] - hf_free[len(prompt) - 1]).max())
    free_delta = np.abs(free_logits - hf_free[len(prompt) - 1:]).max(axis=1)
    agree, divergence = greedy_check(hf_free, len(prompt), our_greedy, args.tie_ulps)
    greedy_tie, greedy_gap = divergence if divergence is not None else (True, 0.0)
    if not args.save_logits:
        shutil.rmtree(dumps)
    else:
        np.save(os.path.join(args.out, f"{name}-transformers.npy"), hf_logits)

    real_flips = len(router.get("real_flips_teacher", [])) + len(router.get("real_flips_free", []))
    passed = len(top1_disagree) == len(top1_ties) and greedy_tie and real_flips == 0
    summary = {
        "checkpoint": args.checkpoint,
        "positions": len(sequence),
        "prompt_length": len(prompt),
        "sliding_window": config.sliding_window,
        "sequence": "prompt + gemma4's greedy continuation[:-1]",
        "max_abs_dlogit": float(delta.max()),
        "max_abs_dlogit_position": int(delta.argmax()),
        "median_abs_dlogit": float(np.median(delta)),
        "max_abs_dlogit_per_position": [round(float(d), 5) for d in delta],
        "prefill_last_position_max_abs_dlogit": prefill_delta,
        "free_running_max_abs_dlogit": float(free_delta.max()),
        "top1_disagreements": top1_disagree,
        "top1_disagreements_within_bf16": top1_ties,
        "greedy_tokens": len(our_greedy),
        "greedy_identical_prefix": agree,
        "greedy_first_divergence_top2_gap": greedy_gap if divergence is not None else None,
        "greedy_divergence_within_bf16": greedy_tie if divergence is not None else None,
        "router": router or None,
        "tie_ulps": args.tie_ulps,
        "router_tie_ulps": args.router_tie_ulps if moe else None,
        "transformers_dtype": args.dtype,
        "transformers_weight_bytes": weight_bytes,
        "transformers_layers_streamed": streamed,
        "transformers_peak_gpu_bytes": (torch.cuda.max_memory_allocated(args.torch_device)
                                        if args.torch_device.startswith("cuda") else None),
        "seconds": {"transformers_load": load_s, "transformers": hf_s,
                    "gemma4_teacher_forced": forced_s, "gemma4_free": free_s},
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if args.torch_device.startswith("cuda") else None,
        "pass": passed,
    }
    with open(os.path.join(args.out, f"{name}-device-check.json"), "w") as f:
        json.dump(summary, f, indent=1)
    peak = summary["transformers_peak_gpu_bytes"]
    peak_text = f", twin peak {peak / 2**30:.1f} GiB" if peak is not None else ""
    greedy_text = (f"greedy {agree}/{len(our_greedy)} reproduced" if divergence is None else
                   f"greedy reproduced for {agree}/{len(our_greedy)}, then a "
                   f"{'bf16 near-tie (gap ' if greedy_tie else 'REAL divergence (gap '}"
                   f"{greedy_gap:.3g})")
    router_text = ""
    if router:
        router_text = (f"router near-ties forced {len(router['forced_near_ties_teacher'])} + "
                       f"{len(router['forced_near_ties_free'])} (unforced: max|dlogit| "
                       f"{router['unforced_max_abs_dlogit']:.3g}), real flips {real_flips}, "
                       f"graphs vs traced {graphs_vs_traced:.3g}; ")
    print(f"device_check {name} vs transformers {args.dtype}"
          f"{' (layers streamed)' if streamed else ''}: {len(sequence)} positions, max|dlogit| {delta.max():.4g} "
          f"(pos {int(delta.argmax())}, median {np.median(delta):.3g}, prefill {prefill_delta:.3g}, "
          f"free-running {free_delta.max():.3g}), "
          f"top-1 {len(sequence) - len(top1_disagree)}/{len(sequence)} "
          f"({len(top1_ties)} of {len(top1_disagree)} disagreements within bf16), {greedy_text}; "
          f"{router_text}"
          f"load {load_s:.0f}s hf {hf_s:.0f}s ours {forced_s + free_s:.0f}s"
          f"{peak_text}: "
          f"{'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
