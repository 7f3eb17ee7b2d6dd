"""Hostile and malformed requests: every one must get a 4xx with an OpenAI-shaped error body,
never a 5xx or a dropped connection, and the server must keep serving afterwards."""
import json
import socket
import time

import pytest

GOOD_CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
GOOD_COMPLETION = {"model": "scripted", "prompt": "hi", "max_tokens": 8}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def raw_request(server, method, path, body: bytes, headers=None, timeout=20):
    """Sends one HTTP/1.1 request over a fresh socket; returns (status, body bytes)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    for key, value in (headers or {"Content-Type": "application/json"}).items():
        head += f"{key}: {value}\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(head.encode() + body)
        response = b""
        try:
            while chunk := sock.recv(65536):
                response += chunk
        except ConnectionResetError:
            pass
    status_line, _, rest = response.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 "), f"no HTTP response: {response[:200]!r}"
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def with_field(base, **fields):
    body = dict(base)
    for key, value in fields.items():
        if value is DELETE:
            body.pop(key, None)
        else:
            body[key] = value
    return body


DELETE = object()


def cases():
    """(name, path, raw body bytes, expected status or None for 'any 4xx')."""
    out = []
    chat = "/v1/chat/completions"
    good = json.dumps(GOOD_CHAT)
    # Broken JSON: every proper prefix of a valid body, plus classic syntax errors.
    for cut in range(0, len(good), 2):
        out.append((f"truncated-{cut}", chat, good[:cut].encode(), 400))
    for i, text in enumerate(["{", "}", "[", "{'model': 'x'}", '{"messages": [}', '{"a":1,}', "nul", "tru",
                              '{"messages": [{"role": "user", "content": "hi"}]} trailing', "\x00\x01\x02",
                              '{"max_tokens": 01}', '{"max_tokens": NaN}', '{"max_tokens": Infinity}',
                              '"just a string"', "[1,2,3]", "42", "null", "true"]):
        out.append((f"syntax-{i}", chat, text.encode(), 400))
    # Deep nesting.
    for depth in (65, 200, 5000, 100000):
        out.append((f"nest-array-{depth}", chat, ("[" * depth + "]" * depth).encode(), 400))
        nested = '{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + '{"a":' * depth + "1" + "}" * depth + "}"
        out.append((f"nest-object-{depth}", chat, nested.encode(), 400))
    # Invalid UTF-8 inside strings.
    for i, bad in enumerate([b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf"]):
        body = b'{"model": "scripted", "messages": [{"role": "user", "content": "a' + bad + b'b"}]}'
        out.append((f"utf8-{i}", chat, body, 400))
    # Wrong types for each field.
    wrong_values = {
        "model": [1, [], {}, True], "messages": ["hi", 1, {}, None, []],
        "temperature": ["1", -1, 3, [], True], "top_p": ["x", -0.5, 1.5, 0], "top_k": [1.5, "3", -2],
        "min_p": [2, "x"], "presence_penalty": [3, "x"], "frequency_penalty": [-3, {}],
        "repetition_penalty": [0, -1, "x"], "seed": ["1", 1.5], "stop": [1, [1], [""], ["a"] * 17],
        "max_tokens": [-1, 0, "10", 1.5, 10**30, 2**40, True], "max_completion_tokens": [-5, "x"],
        "logit_bias": ["x", {"abc": 1}, {"1": 1000}, {"-1": 1}, {"99999999": 1}, {"1": "x"}],
        "logprobs": ["yes", 1], "top_logprobs": [21, -1, "2"], "n": [2, 0, "1"], "stream": ["yes", 1],
        "stream_options": ["x", {"include_usage": "yes"}], "tools": ["x", [1], [{"type": "function"}],
        [{"type": "x", "function": {"name": "f"}}], [{"type": "function", "function": {"name": "bad name!"}}],
        [{"type": "function", "function": {"name": "f", "parameters": "x"}}], [TOOL, TOOL],
        [{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}]],
        "tool_choice": ["sometimes", 1, {"type": "function"}, {"type": "function", "function": {"name": "g"}}],
        "parallel_tool_calls": ["x"], "response_format": [{"type": "json_object"}, "x"],
        "reasoning_effort": ["extreme", 1], "chat_template_kwargs": ["x", [1]], "enable_thinking": ["x"],
        "unknown_field": [1], "functions": [[]], "best_of": [2],
    }
    for field, values in wrong_values.items():
        for i, value in enumerate(values):
            body = with_field(GOOD_CHAT, **{field: value})
            if field == "tool_choice":
                body["tools"] = [TOOL]
            out.append((f"chat-{field}-{i}", chat, json.dumps(body).encode(), 400))
    out.append(("chat-stream-options-without-stream", chat, json.dumps(with_field(GOOD_CHAT, stream_options={"include_usage": True})).encode(), 400))
    out.append(("chat-required-without-tools", chat, json.dumps(with_field(GOOD_CHAT, tool_choice="required")).encode(), 400))
    out.append(("chat-unknown-model", chat, json.dumps(with_field(GOOD_CHAT, model="gpt-4o")).encode(), 400))
    out.append(("chat-no-messages", chat, json.dumps(with_field(GOOD_CHAT, messages=DELETE)).encode(), 400))
    # Bad messages.
    bad_messages = [[1], [{"content": "no role"}], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 5}],
                    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
                    [{"role": "user", "content": [{"text": "no type"}]}], [{"role": "user", "content": [1]}],
                    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                    [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "not json"}}]}],
                    [{"role": "assistant", "tool_calls": "x"}]]
    for i, messages in enumerate(bad_messages):
        out.append((f"chat-messages-{i}", chat, json.dumps(with_field(GOOD_CHAT, messages=messages)).encode(), 400))
    # Context overflow: a huge message, and max_tokens beyond the context.
    huge = with_field(GOOD_CHAT, messages=[{"role": "user", "content": "word " * 5000}])
    out.append(("chat-context-overflow", chat, json.dumps(huge).encode(), 400))
    out.append(("chat-max-tokens-beyond-context", chat, json.dumps(with_field(GOOD_CHAT, max_tokens=100000)).encode(), 400))
    # Bodies beyond the size limit (16 MiB).
    out.append(("chat-oversized-body", chat, b'{"x": "' + b"a" * (17 << 20) + b'"}', 413))
    # Completions.
    comp = "/v1/completions"
    for i, value in enumerate([None, 1, [], [[]], ["a", "b"], [1.5], [-1], [10**9], "", {"x": 1}]):
        out.append((f"completion-prompt-{i}", comp, json.dumps(with_field(GOOD_COMPLETION, prompt=value)).encode(), 400))
    for i, (field, value) in enumerate([("logprobs", 6), ("logprobs", True), ("echo", "x"), ("suffix", "x"), ("best_of", 3),
                                        ("max_tokens", -3), ("messages", []), ("n", 3), ("stop", 1)]):
        out.append((f"completion-{field}-{i}", comp, json.dumps(with_field(GOOD_COMPLETION, **{field: value})).encode(), 400))
    # Tokenizer endpoints.
    for i, body in enumerate([{}, {"content": 1}, {"content": "x", "add_special": "yes"}, [1]]):
        out.append((f"tokenize-{i}", "/tokenize", json.dumps(body).encode(), 400))
    for i, body in enumerate([{}, {"tokens": "x"}, {"tokens": [-1]}, {"tokens": [10**12]}, {"tokens": [1.5]}, {"tokens": [None]}]):
        out.append((f"detokenize-{i}", "/detokenize", json.dumps(body).encode(), 400))
    out.append(("unknown-route", "/v1/nope", b"{}", 404))
    return out


CASES = cases()


def test_there_are_at_least_200_cases():
    assert len(CASES) >= 200


@pytest.mark.parametrize("name,path,body,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_4xx(server, name, path, body, expected):
    status, payload = raw_request(server, "POST", path, body)
    assert 400 <= status < 500, f"{name}: HTTP {status} {payload[:300]!r}"
    if expected:
        assert status == expected, f"{name}: HTTP {status} {payload[:300]!r}"
    error = json.loads(payload)["error"]
    assert error["message"] and error["type"]


def test_context_overflow_message(server):
    huge = with_field(GOOD_CHAT, messages=[{"role": "user", "content": "word " * 5000}])
    status, payload = raw_request(server, "POST", "/v1/chat/completions", json.dumps(huge).encode())
    error = json.loads(payload)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded"
    assert "maximum context length is 2048 tokens" in error["message"]


def test_slowloris_partial_body_is_cut_off(server):
    """A client that announces a body and stalls gets an error and its connection closed, and
    does not block other clients meanwhile."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"mess")
        assert server.alive()  # others are served while this one stalls
        start = time.time()
        response = b""
        try:
            while chunk := sock.recv(4096):
                response += chunk
        except (ConnectionResetError, socket.timeout):
            pass
        assert time.time() - start < 25
    if response:
        status = int(response.split(b" ")[1])
        assert 400 <= status < 500


def test_slow_headers_are_cut_off(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.time()
        try:
            while sock.recv(4096):
                pass
        except (ConnectionResetError, socket.timeout):
            pass
        assert time.time() - start < 25


def test_server_still_serves_after_abuse(server):
    assert server.alive()
    status, payload = raw_request(server, "POST", "/v1/chat/completions", json.dumps(GOOD_CHAT).encode())
    assert status == 200
    assert json.loads(payload)["choices"][0]["message"]["content"]
