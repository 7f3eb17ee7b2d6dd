"""`gemma4 run` end to end: a synthetic tiny checkpoint from `gemma4 synth`, the prompt of the
golden fixture, and the greedy continuation transformers produced (tests/data/golden/tiny.json)."""

import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("GEMMA4_BIN", str(ROOT / "build" / "gemma4"))
FIXTURE = json.loads((ROOT / "tests" / "data" / "golden" / "tiny.json").read_text())


def gemma4(*args, check=True):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=600, check=check)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    gemma4("synth", "--config", FIXTURE["config"], "--format", "bf16", "--grid", FIXTURE["grid"],
           "--seed", FIXTURE["seed"], "-o", out)
    return out


def ids(text):
    return [int(x) for x in text.strip().split(",")]


def test_greedy_matches_transformers(tiny):
    prompt = ",".join(map(str, FIXTURE["prompt"]))
    out = gemma4("run", "-m", tiny, "--prompt-ids", prompt, "-n", len(FIXTURE["greedy"]),
                 "--temperature", 0, "--ignore-eos")
    assert ids(out.stdout) == FIXTURE["greedy"]


def test_cpu_takes_an_explicit_f32_kv_cache(tiny):
    prompt = ",".join(map(str, FIXTURE["prompt"]))
    out = gemma4("run", "-m", tiny, "--prompt-ids", prompt, "-n", len(FIXTURE["greedy"]),
                 "--temperature", 0, "--ignore-eos", "--device", "cpu", "--kv-cache", "f32")
    assert ids(out.stdout) == FIXTURE["greedy"]
    assert "f32) + workspace" in out.stderr  # the memory plan names the KV element type


def test_seeded_sampling_is_reproducible(tiny):
    args = ["run", "-m", tiny, "--prompt-ids", "2,100,200", "-n", 12, "--temperature", 1.0,
            "--top-k", 50, "--ignore-eos"]
    first = ids(gemma4(*args, "--seed", 5).stdout)
    assert len(first) == 12
    assert ids(gemma4(*args, "--seed", 5).stdout) == first
    assert ids(gemma4(*args, "--seed", 6).stdout) != first


@pytest.mark.parametrize("args, message", [
    (["-p", "hello"], "tokenizer"),
    (["--prompt-ids", "2,abc"], "not a token id"),
    (["--prompt-ids", "2,999999999"], "outside the vocabulary"),
    (["--prompt-ids", "2", "--top-p", "0"], "top_p"),
    (["--prompt-ids", "2", "--kv-cache", "fp16"], "expected f32, bf16 or fp8"),
    (["--prompt-ids", "2", "--device", "cpu", "--kv-cache", "bf16"], "keeps an f32 KV cache only"),
])
def test_bad_input_is_a_clear_error(tiny, args, message):
    out = gemma4("run", "-m", tiny, *args, check=False)
    assert out.returncode != 0
    assert message in out.stderr


def test_candidates_and_full_rows_sample_the_same_tokens(tiny, tmp_path):
    # --dump-logits makes every step return its full row; otherwise a top-k sampler gets only the
    # engine's top-k candidates after the penalties (engine.h: step_sampled). Same seed, same ids.
    prompt = ",".join(map(str, FIXTURE["prompt"]))
    sampling = ["--temperature", 0.9, "--top-k", 6, "--seed", 11, "--repetition-penalty", 1.3,
                "--presence-penalty", 0.4, "--frequency-penalty", 0.2]
    candidates = gemma4("run", "-m", tiny, "--prompt-ids", prompt, "-n", 12, "--ignore-eos",
                        *sampling)
    full = gemma4("run", "-m", tiny, "--prompt-ids", prompt, "-n", 12, "--ignore-eos", *sampling,
                  "--dump-logits", tmp_path / "logits.npy")
    assert ids(candidates.stdout) == ids(full.stdout)
    assert len(set(ids(candidates.stdout))) > 1  # it sampled, not a constant stream
