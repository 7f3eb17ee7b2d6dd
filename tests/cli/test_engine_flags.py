"""run, serve and bench take the same engine flags (one registration, cli/engine_flags.h) and
reject the same bad values with the same message, before any model is opened."""

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("GEMMA4_BIN", str(ROOT / "build" / "gemma4"))

ENGINE_FLAGS = ["--device", "--no-graphs", "--no-pdl", "--fp32", "--kv-cache", "--activations",
                "--lm-head", "--gpu-memory", "--threads"]
COMMANDS = ["run", "serve", "bench"]


def gemma4(*args):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_lists_the_engine_flags(command):
    listed = gemma4(command, "--help").stdout
    for flag in ENGINE_FLAGS:
        assert f"  {flag} " in listed or f"  {flag}\n" in listed, (command, flag)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag,value,message", [
    ("--device", "tpu", "--device 'tpu': expected auto, cpu or cuda"),
    ("--activations", "f16", "--activations: 'f16' is none of f32, bf16, q8"),
    ("--gpu-memory", "12XB", "--gpu-memory: memory size '12XB'"),
    ("--lm-head", "q3", "--lm-head"),
])
def test_bad_engine_flags_fail_the_same_way(command, flag, value, message):
    # -m names nothing: the flags must be rejected before the model is looked for.
    prompt = ["--prompt-ids", "2"] if command == "run" else []
    result = gemma4(command, "-m", "/nonexistent/model", *prompt, flag, value)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
