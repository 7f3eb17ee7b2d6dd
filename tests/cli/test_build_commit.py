"""The commit `gemma4 bench` and `gemma4 --version` report is the one the binary was built from
(baked in at build time), not whatever `git` says in the directory the binary runs in."""

import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("GEMMA4_BIN", str(ROOT / "build" / "gemma4"))


def git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)


def source_commit():
    """What the build step derives from the source tree, asked of git directly."""
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return "unknown"
    changes = git("status", "--porcelain", "--untracked-files=no").stdout
    return head.stdout.strip() + ("-dirty" if changes else "")


def gemma4(*args, cwd, env=None):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=300,
                          check=True, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-commit")
    gemma4("synth", "--config", "tiny", "--format", "w4a16", "--seed", 1, "-o", out, cwd=out)
    return out


def bench_commit(tiny, cwd, env=None):
    report = cwd / "bench.json"
    gemma4("bench", "-m", tiny, "--device", "cpu", "--threads", 1, "--depths", "0", "--prefill",
           "4", "--batches", "1", "--decode-tokens", 1, "--json", report, cwd=cwd, env=env)
    return json.loads(report.read_text())["commit"]


def test_bench_reports_the_build_commit_from_another_directory(tiny, tmp_path):
    # tmp_path is outside any git tree: a run-time `git rev-parse` there would say nothing.
    env = {k: v for k, v in os.environ.items() if k != "GEMMA4_COMMIT"}
    assert bench_commit(tiny, tmp_path, env) == source_commit()


def test_environment_overrides_the_commit(tiny, tmp_path):
    env = dict(os.environ, GEMMA4_COMMIT="given-by-env")
    assert bench_commit(tiny, tmp_path, env) == "given-by-env"


def test_version_prints_the_build_commit(tmp_path):
    out = gemma4("--version", cwd=tmp_path)
    assert out.stdout.strip() == f"gemma4 {source_commit()}"
