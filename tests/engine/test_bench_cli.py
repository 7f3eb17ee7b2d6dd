"""`gemma4 bench` smoke test on the CPU engine: a tiny synthetic checkpoint, a few short
measurements, and the JSON the GPU acceptance runs are recorded with (issue 4 item 8)."""

import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("GEMMA4_BIN", str(ROOT / "build" / "gemma4"))


def gemma4(*args, check=True):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=300,
                          check=check)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-w4a16")
    gemma4("synth", "--config", "tiny", "--format", "w4a16", "--seed", 1, "-o", out)
    return out


def test_bench_json_on_cpu(tiny, tmp_path):
    report = tmp_path / "bench.json"
    out = gemma4("bench", "-m", tiny, "--device", "cpu", "--threads", 2, "--depths", "0,40",
                 "--prefill", "24", "--batches", "1,3", "--decode-tokens", 3, "--json", report)
    data = json.loads(report.read_text())
    for key in ("model", "format", "gpu", "commit", "decode", "prefill", "peak_gpu_mib",
                "kernels_per_token"):
        assert key in data, key
    assert data["format"] == "w4g32"
    assert data["gpu"] == "none" and data["peak_gpu_mib"] is None
    # The CPU backend counts no kernels: reported as unknown, never made up.
    assert data["kernels_per_token"] is None
    assert [(d["batch"], d["depth"]) for d in data["decode"]] == [(1, 0), (1, 40), (3, 32)]
    assert [p["tokens"] for p in data["prefill"]] == [24]
    figures = [d["tok_per_s"] for d in data["decode"]] + [p["tok_per_s"] for p in data["prefill"]]
    assert all(f > 0 for f in figures), figures
    assert data["weight_bytes_per_token"] > 0
    # What decode matmuls read: the CPU reference computes in fp32 whatever --activations says.
    assert data["activations"] == "f32"
    # Timed decode steps chain greedy tokens (Engine::decode_greedy); both outputs say so.
    assert data["sampling"].startswith("greedy tokens chained")
    assert "sampling: greedy tokens chained" in out.stdout
    # The table names every measurement too.
    assert "decode" in out.stdout and "prefill" in out.stdout and "n/a" in out.stdout


def test_no_chain_steps_as_a_serving_loop(tiny, tmp_path):
    report = tmp_path / "bench.json"
    out = gemma4("bench", "-m", tiny, "--device", "cpu", "--threads", 2, "--depths", "0",
                 "--prefill", "8", "--batches", "1,2", "--decode-tokens", 2, "--no-chain",
                 "--json", report)
    data = json.loads(report.read_text())
    # Timed steps return greedy candidates, as a server's greedy requests do.
    assert data["sampling"].startswith("greedy candidates")
    assert "sampling: greedy candidates" in out.stdout
    assert all(d["tok_per_s"] > 0 for d in data["decode"])


def test_depths_are_clipped_to_the_context(tiny, tmp_path):
    report = tmp_path / "bench.json"
    gemma4("bench", "-m", tiny, "--device", "cpu", "--threads", 2, "-c", 64, "--depths",
           "0,1000", "--prefill", "16,1000", "--batches", "1", "--decode-tokens", 2,
           "--json", report)
    data = json.loads(report.read_text())
    assert [d["depth"] for d in data["decode"]] == [0, 64 - 2 - 2]
    assert [p["tokens"] for p in data["prefill"]] == [16]


def test_streams_are_clipped_to_parallel(tiny, tmp_path):
    report = tmp_path / "bench.json"
    gemma4("bench", "-m", tiny, "--device", "cpu", "--threads", 2, "--depths", "0", "--prefill",
           "8", "--batches", "2,8,64", "--parallel", 4, "--decode-tokens", 2, "--json", report)
    data = json.loads(report.read_text())
    assert [d["batch"] for d in data["decode"]] == [1, 2, 4]


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu"], "--device"),
    (["--device", "cuda"], "--device cuda"),  # CI has no GPU (or no CUDA build)
    (["--decode-tokens", "0"], "--decode-tokens"),
    (["--batches", "0"], "--batches"),
    (["--activations", "fp8"], "--activations"),
    (["--fp32", "--activations", "q8"], "--fp32"),
])
def test_bad_arguments_are_clear_errors(tiny, args, message):
    out = gemma4("bench", "-m", tiny, *args, check=False)
    assert out.returncode != 0
    assert message in out.stderr


# `--profile-last`: accepted and harmless where no profiler range exists (the CPU backend's
# no-op), refused with a clear error for a kind it does not know.
def test_profile_last_runs_every_kind_on_cpu(tiny, tmp_path):
    report = tmp_path / "bench.json"
    gemma4("bench", "-m", tiny, "--device", "cpu", "--threads", 1, "--depths", "0,8", "--prefill",
           "4,6", "--batches", "1,2", "--decode-tokens", 1, "--profile-last",
           "decode,prefill,batched", "--json", report)
    data = json.loads(report.read_text())
    # The batched depth is clipped to the single-stream context: 8 + 1 decode token + 2 - 3.
    assert [(d["batch"], d["depth"]) for d in data["decode"]] == [(1, 0), (1, 8), (2, 8)]
    assert [p["tokens"] for p in data["prefill"]] == [4, 6]
    assert all(d["tok_per_s"] > 0 for d in data["decode"] + data["prefill"])


def test_unknown_profile_kind_is_a_clear_error(tiny):
    out = gemma4("bench", "-m", tiny, "--device", "cpu", "--profile-last", "decode,everything",
                 check=False)
    assert out.returncode != 0
    assert "--profile-last" in out.stderr and "everything" in out.stderr, out.stderr


def test_help_says_how_to_profile_with_ncu():
    out = gemma4("bench", "--help")
    assert "--profile-last" in out.stdout and "ncu --profile-from-start off" in out.stdout


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    """Plain bf16 values: the tied embedding is off the int4 grid, so --lm-head q8 applies."""
    out = tmp_path_factory.mktemp("tiny-bf16")
    gemma4("synth", "--config", "tiny", "--format", "bf16", "--grid", "none", "--seed", 1, "-o", out)
    return out


def test_lm_head_q8_is_reported_and_halves_the_logits_bytes(tiny_bf16, tmp_path):
    reports = {}
    for lm_head in ("exact", "q8"):
        report = tmp_path / f"bench-{lm_head}.json"
        out = gemma4("bench", "-m", tiny_bf16, "--device", "cpu", "--threads", 2, "--depths", "0",
                     "--prefill", "8", "--batches", "1", "--decode-tokens", 2, "--lm-head",
                     lm_head, "--json", report)
        reports[lm_head] = json.loads(report.read_text())
        if lm_head == "q8":
            assert "the logits matrix quantized to 8 bits (--lm-head q8)" in out.stderr
    assert reports["exact"]["lm_head"] == "bf16"
    assert reports["q8"]["lm_head"] == "w8 quantized at load by --lm-head q8"
    # int8 + one fp16 scale per 32 values against bf16: 1.0625 / 2 of the logits matrix's bytes.
    vocab, hidden = 262144, 64
    saved = reports["exact"]["weight_bytes_per_token"] - reports["q8"]["weight_bytes_per_token"]
    assert saved == pytest.approx(vocab * hidden * (2 - 1.0625))


def test_lm_head_rejects_unknown_formats(tiny_bf16):
    out = gemma4("run", "-m", tiny_bf16, "--device", "cpu", "--prompt-ids", "2", "-n", 1,
                 "--lm-head", "q4", check=False)
    assert out.returncode != 0
    assert "--lm-head" in out.stderr and "expected exact or q8" in out.stderr
