#!/usr/bin/env python3
"""Golden logits for the C++ model tests, from Hugging Face transformers.

Loads a synthetic bf16 checkpoint written by `gemma4 synth` into `Gemma4ForCausalLM` (eager
attention, float32 weights and activations), runs a fixed prompt longer than the tiny configs'
sliding window, and writes a small JSON fixture:

  prompt            the token ids (BOS + ids from the real vocabulary)
  greedy            32 greedy tokens after the prompt (full recompute every step, no cache)
  positions[i]      for every position of prompt + greedy[:-1]: the top-16 ids and logits and
                    the log-sum-exp over the whole vocabulary
  sampled           at a few positions, the logits of every `vocab_stride`-th token id

Run with the reference environment (torch CPU + transformers with Gemma 4), e.g.
  gemma4 synth --config tiny --format bf16 --grid none --seed 1 -o /tmp/tiny
  /opt/refenv/bin/python tools/reference/golden.py --checkpoint /tmp/tiny --config tiny \
      --grid none --seed 1 --out tests/data/golden/tiny.json
The checkpoint itself is not committed: the C++ test regenerates it from (config, seed).
"""

import argparse
import json
import os
import sys

import torch
import transformers
from safetensors.torch import load_file
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

PROMPT_LENGTH = 48
GREEDY_TOKENS = 32
TOP_K = 16
VOCAB_STRIDE = 512


def fixed_prompt(length):
    """BOS followed by ids spread over the ordinary-text part of the vocabulary (a fixed LCG,
    so the prompt is the same everywhere without depending on any library's RNG)."""
    ids = [2]
    state = 20260415
    while len(ids) < length:
        state = (state * 1103515245 + 12345) % (1 << 31)
        ids.append(300 + state % 250000)
    return ids


def load_model(checkpoint):
    with open(os.path.join(checkpoint, "config.json")) as f:
        config_json = json.load(f)
    text = config_json.get("text_config", config_json)
    config = Gemma4TextConfig(**{k: v for k, v in text.items() if k not in ("architectures",)})
    config._attn_implementation = "eager"
    model = Gemma4ForCausalLM(config).to(torch.float32).eval()

    tensors = {}
    for name in sorted(os.listdir(checkpoint)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(checkpoint, name)))
    state = {}
    for name, tensor in tensors.items():
        for prefix in ("model.language_model.", "model."):
            if name.startswith(prefix):
                state["model." + name[len(prefix):]] = tensor.to(torch.float32)
                break
        else:
            state[name] = tensor.to(torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    ignorable = set(model.model._keys_to_ignore_on_load_unexpected)
    unexpected = [k for k in unexpected if k[len("model."):] not in ignorable]
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        sys.exit(f"checkpoint does not match Gemma4ForCausalLM: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    return model, config


@torch.no_grad()
def logits_of(model, ids):
    out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].to(torch.float32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="synthetic bf16 checkpoint directory")
    parser.add_argument("--config", required=True, help="synth config name (recorded)")
    parser.add_argument("--seed", type=int, required=True, help="synth seed (recorded)")
    parser.add_argument("--grid", default="none", help="synth value grid: none, w4g32, nvfp4 (recorded)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.manual_seed(0)
    model, config = load_model(args.checkpoint)
    prompt = fixed_prompt(PROMPT_LENGTH)
    assert PROMPT_LENGTH > config.sliding_window, "the prompt must be longer than the sliding window"

    tokens = list(prompt)
    gaps = []
    for _ in range(GREEDY_TOKENS):
        last = logits_of(model, tokens)[-1]
        top2 = torch.topk(last, 2)
        gaps.append(float(top2.values[0] - top2.values[1]))
        tokens.append(int(torch.argmax(last)))
    greedy = tokens[len(prompt):]

    logits = logits_of(model, tokens[:-1])  # every position whose next token was predicted
    assert [int(x) for x in torch.argmax(logits[len(prompt) - 1:], dim=-1)] == greedy

    positions = []
    for row in logits:
        top = torch.topk(row, TOP_K)
        positions.append({
            "ids": [int(i) for i in top.indices],
            "logits": [round(float(v), 6) for v in top.values],
            "logsumexp": round(float(torch.logsumexp(row.double(), dim=0)), 6),
        })
    sampled_at = [0, config.sliding_window, PROMPT_LENGTH - 1, len(tokens) - 2]
    fixture = {
        "generator": "tools/reference/golden.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "config": args.config,
        "seed": args.seed,
        "grid": args.grid,
        "prompt": prompt,
        "greedy": greedy,
        "greedy_top2_gap": [round(g, 6) for g in gaps],
        "top_k": TOP_K,
        "positions": positions,
        "vocab_stride": VOCAB_STRIDE,
        "sampled": [{"position": p, "logits": [round(float(v), 6) for v in logits[p, ::VOCAB_STRIDE]]} for p in sampled_at],
    }
    with open(args.out, "w") as f:
        json.dump(fixture, f, separators=(",", ":"))
        f.write("\n")
    print(f"{args.out}: {len(positions)} positions, greedy {greedy[:8]}..., min top-2 gap {min(gaps):.4g}")


if __name__ == "__main__":
    main()
