"""--gpu-memory on run, bench and serve: a malformed size is a clear error before any model is
loaded; on the CPU engine the budget is ignored with a note, and every load logs its memory plan
(engine/memory_plan.h). Fitting a budget on a GPU is covered by tests/engine/memory_plan_test.cpp
and run on the GPU machine (`gemma4 bench --gpu-memory 3732MiB`)."""

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("GEMMA4_BIN", str(ROOT / "build" / "gemma4"))


def gemma4(*args, check=True):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=600, check=check)


@pytest.fixture(scope="module")
def tiny_w4a16(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_w4a16")
    gemma4("synth", "--config", "tiny", "--format", "w4a16", "--seed", 1, "-o", out)
    return out


@pytest.mark.parametrize("command", [
    ["run", "--prompt-ids", "2,100", "-n", 1],
    ["bench", "--quick"],
    ["serve", "--port", 0],
])
def test_malformed_size_is_a_clear_error(tiny_w4a16, command):
    out = gemma4(command[0], "-m", tiny_w4a16, *command[1:], "--gpu-memory", "12XB", check=False)
    assert out.returncode != 0
    assert "--gpu-memory" in out.stderr and "'12XB'" in out.stderr


def test_cpu_engine_logs_its_plan_and_ignores_the_budget(tiny_w4a16):
    out = gemma4("run", "-m", tiny_w4a16, "--device", "cpu", "--prompt-ids", "2,100,200", "-n", 2,
                 "--gpu-memory", "3732MiB")
    assert len(out.stdout.strip().split(",")) == 2
    assert "--gpu-memory ignored" in out.stderr
    assert "memory plan: weights read in place + KV" in out.stderr
    assert "(1 x 5 tokens, passes of " in out.stderr
