"""`gemma4 bench --profile-last`: accepted and harmless where no profiler range exists (the CPU
backend's no-op), refused with a clear error for a kind it does not know."""

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
    out = tmp_path_factory.mktemp("tiny-profile")
    gemma4("synth", "--config", "tiny", "--format", "w4a16", "--seed", 1, "-o", out)
    return out


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
