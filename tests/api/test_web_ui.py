"""Headless Chromium opens the web UI, sends a message (through the page's ?q= link), and must
show the streamed answer and a collapsible thinking block. The screenshot is kept in
$GEMMA4_ARTIFACTS (CI artifact) or the test's temporary folder."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(not CHROMIUM, reason="chromium is not installed")


def chromium(*args):
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1100,700",
                           "--virtual-time-budget=30000", *args], capture_output=True, text=True, timeout=120)


def test_page_is_served(server):
    status, page = server.get("/")
    assert status == 200
    assert "<title>gemma4</title>" in page and "/v1/chat/completions" in page
    assert "<script src" not in page and "<link" not in page  # self-contained: no CDN


def test_ui_streams_answer_with_thinking(server, tmp_path):
    url = server.url + "/?q=Please%20think%20about%20it&think=1"
    for _ in range(6):  # the DOM is dumped when virtual time runs out; the stream may lag behind
        dom = chromium("--dump-dom", url).stdout
        if "The answer is 42." in dom and "md cursor" not in dom:
            break
    assert "The answer is 42." in dom
    assert '<details class="thinking"' in dom and "Let me think." in dom
    artifacts = Path(os.environ.get("GEMMA4_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    screenshot = artifacts / "web-ui.png"
    chromium(f"--screenshot={screenshot}", url)
    assert screenshot.exists() and screenshot.stat().st_size > 10000
