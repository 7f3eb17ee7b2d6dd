"""MoE router traces: gemma4's (`gemma4 run --router-trace FILE`) against transformers'.

A gemma4 trace is a float32 .npy of one row per (forward pass, MoE layer, token):
[layer, position, num_experts router logits, top_k expert ids, top_k routing weights]. Here it is
read into arrays indexed [layer, position]. transformers' side is captured with forward hooks on
every decoder layer's router (Gemma4TextRouter: its proj's output are the logits, its own output
the picks) during a forward over the same ids, which may also FORCE our picks where the two sides
differ only by a near-tie (see RouterForcing).

Near-tie: the top_k sets differ, and in transformers' logits the weakest expert only it picked
beats the strongest expert only we picked by at most `tie_ulps` bf16 ulps of the row's largest
|logit| (the rule device_check applies to the final logits' top-2). A flip with a larger gap
is a real divergence. A flip can only happen where the gap is at most twice the row's largest
|logit difference| (delta), so every report also gives delta: a large one is a bug whatever
the picks.

Standalone (CPU, a tiny model): python tools/reference/router_trace.py --checkpoint DIR
--gemma4 build/gemma4 runs gemma4 teacher-forced with --router-trace on the device_check prompt,
captures transformers over the same ids and prints the first (position, layer) whose picks differ;
device_check.py does the same for MoE checkpoints and forces near-ties.
"""

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Trace:
    """Router logits [layers, positions, experts], ids and weights [layers, positions, top_k];
    `seen` [layers, positions] marks the entries the trace holds."""
    logits: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    seen: np.ndarray


def empty_trace(layers, positions, num_experts, top_k):
    return Trace(np.zeros((layers, positions, num_experts), np.float32),
                 np.full((layers, positions, top_k), -1, np.int64),
                 np.zeros((layers, positions, top_k), np.float32),
                 np.zeros((layers, positions), bool))


def load(path, layers, positions, num_experts, top_k):
    """gemma4's trace file; a later row for the same (layer, position) replaces an earlier one."""
    rows = np.load(path)
    if rows.ndim != 2 or rows.shape[1] != 2 + num_experts + 2 * top_k:
        raise ValueError(f"{path}: rows of {rows.shape[1:]} floats, expected "
                         f"{2 + num_experts + 2 * top_k} (num_experts {num_experts}, top_k {top_k})")
    trace = empty_trace(layers, positions, num_experts, top_k)
    for row in rows:
        layer, position = int(row[0]), int(row[1])
        if position >= positions:
            continue
        trace.logits[layer, position] = row[2:2 + num_experts]
        trace.ids[layer, position] = row[2 + num_experts:2 + num_experts + top_k].astype(np.int64)
        trace.weights[layer, position] = row[2 + num_experts + top_k:]
        trace.seen[layer, position] = True
    return trace


def bf16_ulp(value):
    return 2.0 ** (math.floor(math.log2(max(abs(value), 1e-30))) - 7)


@dataclass
class Flip:
    """A (layer, position) whose top_k sets differ."""
    layer: int
    position: int
    gap: float        # transformers' logit margin of its weakest own pick over our strongest
    our_gap: float    # the same margin in our logits, the other way round
    delta: float      # max |our logit - transformers' logit| of the row
    tie: bool
    hf_ids: list
    our_ids: list

    def describe(self, reference_logits):
        order = np.argsort(-reference_logits, kind="stable")[:len(self.hf_ids) + 1]
        top = ", ".join(f"{e}:{reference_logits[e]:.6g}" for e in order)
        kind = "near-tie" if self.tie else "REAL divergence"
        return (f"layer {self.layer} position {self.position}: {kind}, transformers picks "
                f"{sorted(self.hf_ids)} and we {sorted(self.our_ids)}; margin {self.gap:.3g} in "
                f"transformers' logits, {self.our_gap:.3g} in ours, row max |dlogit| "
                f"{self.delta:.3g}; transformers' top {len(order)}: {top}")


def classify(layer, position, hf_logits, our_logits, hf_ids, our_ids, tie_ulps):
    """A Flip for differing picks, else None."""
    only_hf = set(int(e) for e in hf_ids) - set(int(e) for e in our_ids)
    only_ours = set(int(e) for e in our_ids) - set(int(e) for e in hf_ids)
    if not only_hf and not only_ours:
        return None
    delta = float(np.abs(our_logits - hf_logits).max())
    if not only_hf or not only_ours:  # an invalid pick (id -1) on one side
        return Flip(layer, position, math.inf, math.inf, delta, False,
                    [int(e) for e in hf_ids], [int(e) for e in our_ids])
    gap = min(hf_logits[a] for a in only_hf) - max(hf_logits[b] for b in only_ours)
    our_gap = min(our_logits[b] for b in only_ours) - max(our_logits[a] for a in only_hf)
    tie = gap <= tie_ulps * bf16_ulp(float(np.abs(hf_logits).max()))
    return Flip(layer, position, float(gap), float(our_gap), delta, bool(tie),
                [int(e) for e in hf_ids], [int(e) for e in our_ids])


def compare(ours, reference, tie_ulps):
    """Every flip between two traces (positions both hold), ordered by (position, layer), and
    the largest row |dlogit| over the rows whose picks agree."""
    flips = []
    agree_delta = 0.0
    layers, positions = np.nonzero(ours.seen & reference.seen)
    for layer, position in sorted(zip(layers.tolist(), positions.tolist()), key=lambda lp: lp[::-1]):
        flip = classify(layer, position, reference.logits[layer, position],
                        ours.logits[layer, position], reference.ids[layer, position],
                        ours.ids[layer, position], tie_ulps)
        if flip is not None:
            flips.append(flip)
        else:
            agree_delta = max(agree_delta, float(np.abs(
                ours.logits[layer, position] - reference.logits[layer, position]).max()))
    return flips, agree_delta


def first_flips(flips):
    """The flips no other flip can have caused: (l, p) influences only (l', p') with l' > l and
    p' >= p (a later layer at the same or a later position)."""
    roots = []
    for f in flips:
        if not any(r.layer < f.layer and r.position <= f.position for r in roots):
            roots.append(f)
    return roots


def routers(model):
    """(layer index, Gemma4TextRouter) of every MoE layer."""
    return [(i, layer.router) for i, layer in enumerate(model.model.layers)
            if getattr(layer, "enable_moe_block", False)]


class RouterForcing:
    """Forward hooks that record transformers' router logits and picks at every (layer,
    position) of a batch-1 forward and, with `ours`, replace its picks by ours wherever the two
    differ by a near-tie (classify() on transformers' logits of that very forward, so a forced
    flip's consequences are what later layers see). The forced picks' weights come from
    transformers' own probabilities: renormalised over our ids, times per_expert_scale."""

    def __init__(self, model, positions, ours=None, tie_ulps=2.0):
        self.ours = ours
        self.tie_ulps = tie_ulps
        self.hooked = routers(model)
        config = model.config
        layers = len(model.model.layers)
        # A dense model has no routers: nothing to record.
        self.trace = (empty_trace(layers, positions, config.num_experts, config.top_k_experts)
                      if self.hooked else None)
        self.forced = []     # Flips replaced by our picks
        self.unforced = []   # Flips left as they were (real divergences)
        self.handles = []

    def __enter__(self):
        for index, router in self.hooked:
            self.handles.append(router.proj.register_forward_hook(self._logits_hook(index)))
            self.handles.append(router.register_forward_hook(self._picks_hook(index, router)))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _logits_hook(self, index):
        def hook(module, inputs, output):
            rows = output.detach().reshape(-1, output.shape[-1]).float().cpu().numpy()
            self.trace.logits[index, :len(rows)] = rows
        return hook

    def _picks_hook(self, index, router):
        def hook(module, inputs, output):
            probabilities, weights, ids = output
            ids_cpu = ids.detach().cpu().numpy()
            count = len(ids_cpu)
            if self.ours is not None:
                new_ids, new_weights = ids.clone(), weights.clone()
                for position in range(count):
                    if not self.ours.seen[index, position]:
                        continue
                    flip = classify(index, position, self.trace.logits[index, position],
                                    self.ours.logits[index, position], ids_cpu[position],
                                    self.ours.ids[index, position], self.tie_ulps)
                    if flip is None:
                        continue
                    if not flip.tie:
                        self.unforced.append(flip)
                        continue
                    self.forced.append(flip)
                    picked = torch.as_tensor(self.ours.ids[index, position], device=ids.device)
                    chosen = probabilities[position, picked]
                    new_ids[position] = picked
                    new_weights[position] = (chosen / chosen.sum() *
                                             router.per_expert_scale[picked]).to(weights.dtype)
                ids, weights = new_ids, new_weights
                output = (probabilities, weights, ids)
            self.trace.ids[index, :count] = ids.detach().cpu().numpy()
            self.trace.weights[index, :count] = weights.detach().float().cpu().numpy()
            self.trace.seen[index, :count] = True
            return output
        return hook


@torch.no_grad()
def reference_logits(model, ids, device, ours=None, tie_ulps=2.0):
    """transformers' logits at every position of `ids` (one forward, no cache) and its router
    trace; with `ours`, near-tie flips forced to our picks (RouterForcing)."""
    with RouterForcing(model, len(ids), ours, tie_ulps) as forcing:
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits
    return logits[0].float().cpu().numpy(), forcing


def report(flips, agree_delta, reference, label):
    """Lines describing a comparison of traces (for people)."""
    lines = []
    roots = first_flips(flips)
    ties = sum(f.tie for f in flips)
    lines.append(f"{label}: {len(flips)} (layer, position) picks differ ({ties} near-ties), "
                 f"{len(roots)} of them not caused by an earlier one; max router |dlogit| where "
                 f"the picks agree {agree_delta:.3g}")
    for f in roots[:8]:
        lines.append("  " + f.describe(reference.logits[f.layer, f.position]))
    return lines


def main():
    import argparse
    import os
    import subprocess
    import tempfile

    from device_check import build_model  # noqa: E402 (beside this script)
    from golden import fixed_prompt  # noqa: E402

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--gemma4", default="build/gemma4")
    parser.add_argument("--device", default="cpu", help="gemma4 --device")
    parser.add_argument("--torch-device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    parser.add_argument("--gemma4-flag", action="append", default=[])
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--tie-ulps", type=float, default=2.0)
    args = parser.parse_args()
    ids = fixed_prompt(args.prompt_length)
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "router.npy")
        subprocess.run([args.gemma4, "run", "-m", args.checkpoint, "--device", args.device,
                        "--prompt-ids", ",".join(map(str, ids)), "-n", "1", "--temperature", "0",
                        "--prompt-chunk", "1", "--router-trace", path, *args.gemma4_flag],
                       check=True, capture_output=True)
        model, config = build_model(args.checkpoint, args.torch_device, getattr(torch, args.dtype))
        ours = load(path, config.num_hidden_layers, len(ids), config.num_experts,
                    config.top_k_experts)
    _, plain = reference_logits(model, ids, args.torch_device)
    flips, agree_delta = compare(ours, plain.trace, args.tie_ulps)
    print("\n".join(report(flips, agree_delta, plain.trace, "router picks vs transformers")))
    return 0 if all(f.tie for f in flips) else 1


if __name__ == "__main__":
    raise SystemExit(main())
