"""`gemma4 bench --timeline` records CUDA kernels (CUPTI, loaded at run time): asked of the CPU
engine it fails with a message that says so, before any measurement, and writes no file. The
timeline arithmetic itself is tested in tests/core/kernel_timeline_test.cpp; the recording needs a
GPU (scripts/gpu-check territory)."""

import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("GEMMA4_BIN", str(ROOT / "build" / "gemma4"))


def gemma4(*args, check=True):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=300,
                          check=check)


def test_timeline_on_the_cpu_is_a_clear_error(tmp_path):
    model = tmp_path / "tiny"
    gemma4("synth", "--config", "tiny", "--format", "w4a16", "--seed", 1, "-o", model)
    timeline = tmp_path / "timeline.tsv"
    out = gemma4("bench", "-m", model, "--device", "cpu", "--depths", "0", "--prefill", "8",
                 "--batches", "1", "--decode-tokens", 2, "--timeline", timeline, check=False)
    assert out.returncode == 1
    assert "--timeline records CUDA kernels" in out.stderr, out.stderr
    assert "decode at depth" not in out.stderr  # refused before measuring
    assert not timeline.exists()
