"""Fixtures for the API tests: start the real `gemma4 serve` (binary from $GEMMA4_BIN) on a
free port, wait until it is ready, stop it afterwards."""
import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

SHARED_DATA = Path(os.environ.get("GEMMA4_SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
TOKENIZER = SHARED_DATA / "tokenizer" / "tokenizer.json"
COMPACT_TEMPLATE = SHARED_DATA / "chat-templates" / "gemma4-compact.jinja"

# Scripted replies: the engine replays the reply whose trigger text occurs last in the prompt.
WEATHER_CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
SCRIPT = {
    "replies": [
        {"reply": "Hello there! How can I help?<turn|>"},
        {"when": " weather", "reply": "<|channel>thought\nThe user wants the weather.<channel|>" + WEATHER_CALL + "<|tool_response>"},
        {"when": " both cities", "reply": WEATHER_CALL + '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|><|tool_response>'},
        {"when": "18C", "reply": "It is 18C in Paris.<turn|>"},
        {"when": " think", "reply": "<|channel>thought\nLet me think.<channel|>The answer is 42.<turn|>"},
        {"when": " story", "reply": "Once upon a time there was a dragon. THE END and then more text.<turn|>"},
        {"when": " forever", "reply": "la " * 400 + "<turn|>"},
        # Continuations of the call openers that tool_choice "required" / named force into the
        # prompt: they can only be reached when the server forced the opener.
        {"when": "call:get_weather{", "reply": 'city:<|"|>Oslo<|"|>}<tool_call|><|tool_response>'},
        {"when": "call:", "reply": 'get_time{zone:<|"|>UTC<|"|>}<tool_call|><|tool_response>'},
    ]
}


def binary() -> str:
    path = os.environ.get("GEMMA4_BIN")
    if not path or not Path(path).exists():
        pytest.skip("GEMMA4_BIN is not set to a built gemma4 binary")
    return path


class Server:
    def __init__(self, args, tmp_path: Path):
        self.log_path = tmp_path / "server.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([binary(), "serve", "--port", "0", *args], stdout=self.log, stderr=subprocess.STDOUT)
        self.port = None
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gemma4 serve exited: {self.log_path.read_text()}")
            match = re.search(r"listening on http://[^:]+:(\d+)", self.log_path.read_text())
            if match and self.port is None:
                self.port = int(match.group(1))
            if self.port and self.get("/health")[0] == 200:
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gemma4 serve did not become ready: {self.log_path.read_text()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path):
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
        except OSError:
            return 0, ""

    def metric(self, name: str) -> float:
        status, text = self.get("/metrics")
        assert status == 200
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))

    def alive(self) -> bool:
        return self.proc.poll() is None and self.get("/health")[0] == 200

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def scripted_server(tmp_path_factory, name, step_delay_ms=0, extra=()):
    tmp = tmp_path_factory.mktemp(name)
    script = tmp / "script.json"
    script.write_text(json.dumps({**SCRIPT, "step_delay_ms": step_delay_ms}))
    return Server(["--scripted-engine", str(script), "--tokenizer", str(TOKENIZER),
                   "--chat-template", str(COMPACT_TEMPLATE), *extra], tmp)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = scripted_server(tmp_path_factory, "scripted", extra=["-np", "8", "-c", "2048"])
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def slow_server(tmp_path_factory):
    """One slot, one queue place, 20 ms per step: for cancellation and queue-full tests."""
    srv = scripted_server(tmp_path_factory, "slow", step_delay_ms=20, extra=["-np", "1", "--max-queue", "1"])
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny synthetic checkpoint from `gemma4 synth` (random weights)."""
    out = tmp_path_factory.mktemp("tiny") / "model"
    result = subprocess.run([binary(), "synth", "--config", "tiny", "--tokenizer", str(TOKENIZER),
                             "--chat-template", str(COMPACT_TEMPLATE), "-o", str(out)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"gemma4 synth failed: {result.stderr.strip()}")
    return out


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory, tiny_model):
    srv = Server(["-m", str(tiny_model), "-np", "4", "-c", "1024", "--alias", "tiny"], tmp_path_factory.mktemp("tiny-server"))
    yield srv
    srv.stop()
