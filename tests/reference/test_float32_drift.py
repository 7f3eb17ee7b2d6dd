"""tools/reference/float32_drift.py and cuda_vs_cpu.py (with --device cpu) on the tiny synthetic
W4A16 checkpoint: they run, and at this depth every float32 run (our CPU engine, transformers) is
within 1e-4 of transformers float64. Needs torch + transformers with Gemma 4 (the reference
environment); skipped without them."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers.models.gemma4")

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("GEMMA4_BIN", str(ROOT / "build" / "gemma4"))
TOOLS = ROOT / "tools" / "reference"


@pytest.fixture(scope="module")
def tiny_w4a16(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-w4a16")
    subprocess.run([BIN, "synth", "--config", "tiny", "--format", "w4a16", "--seed", "1", "-o",
                    str(out)], check=True, capture_output=True, timeout=300)
    return out


def test_float32_drift_reports_engine_and_transformers_against_float64(tiny_w4a16):
    result = subprocess.run(
        [sys.executable, str(TOOLS / "float32_drift.py"), "--checkpoint", str(tiny_w4a16),
         "--gemma4", BIN, "--chunk", "7"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    # embeddings + one line per decoder layer (tiny: 5)
    assert len(re.findall(r"^\s+(embeddings|layer \d+)", result.stdout, re.M)) == 6
    for label in ("our CPU engine vs float64", "transformers float32 vs float64"):
        found = re.search(re.escape(label) + r".*max \|dlogit\| (\S+),", result.stdout)
        assert found, result.stdout
        assert float(found[1]) < 1e-4, result.stdout


def test_cuda_vs_cpu_runs_on_the_cpu(tiny_w4a16, tmp_path):
    result = subprocess.run(
        [sys.executable, str(TOOLS / "cuda_vs_cpu.py"), "--checkpoint", str(tiny_w4a16),
         "--gemma4", BIN, "--device", "cpu", "--chunk", "27", "--prompt-length", "54",
         "--twin-devices", "cpu,cpu:float64", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / f"{tiny_w4a16.name}-cuda-vs-cpu.json").read_text())
    assert summary["positions"] == [26, 53]
    # 4 runs compared pairwise at the step ends
    assert len(summary["pairs"]) == 10
    assert all(pair["max"] < 1e-4 for pair in summary["pairs"].values()), summary["pairs"]
