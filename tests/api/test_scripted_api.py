"""The OpenAI Python client against `gemma4 serve` with the scripted engine, which forces exact
model outputs (tool calls, thinking) through the real scheduler, parser and HTTP layers."""
import json
import socket
import threading
import time
import urllib.request

import openai
import pytest

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def client(server, **kwargs):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, **kwargs)


def post(server, path, body):
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["scripted"]
    entry = models.data[0].model_dump()
    assert entry["context_length"] == 2048
    assert "tools" in entry["capabilities"]
    assert server.get("/health")[0] == 200


def test_chat_non_streaming(server):
    reply = client(server).chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
    choice = reply.choices[0]
    assert choice.message.content == "Hello there! How can I help?"
    assert choice.finish_reason == "stop"
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    timings = reply.model_extra["timings"]
    assert timings["predicted_n"] == reply.usage.completion_tokens
    assert timings["prompt_ms"] >= 0 and timings["predicted_per_second"] > 0


def test_chat_streaming_with_usage(server):
    stream = client(server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "hello"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there! How can I help?"
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_content_parts_and_system_message(server):
    reply = client(server).chat.completions.create(model="scripted", messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}])
    assert reply.choices[0].message.content == "Hello there! How can I help?"


def test_reasoning_split_non_streaming(server):
    reply = client(server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Please think about it"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = reply.choices[0].message
    assert message.content == "The answer is 42."
    assert message.model_extra["reasoning_content"] == "Let me think."
    assert message.model_extra["reasoning"] == "Let me think."


def test_reasoning_split_streaming(server):
    stream = client(server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Please think about it"}], stream=True,
        reasoning_effort="high")
    reasoning, content = "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert reasoning == "Let me think."
    assert content == "The answer is 42."


def test_tool_call_flow(server):
    c = client(server)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.chat.completions.create(model="scripted", messages=messages, tools=[WEATHER_TOOL])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18C"})
    second = c.chat.completions.create(model="scripted", messages=messages, tools=[WEATHER_TOOL])
    assert second.choices[0].message.content == "It is 18C in Paris."
    assert second.choices[0].finish_reason == "stop"
    # The second turn extends the first: the prefix cache served part of its prompt.
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_tool_call_streaming_deltas(server):
    stream = client(server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "weather in both cities"}],
        tools=[WEATHER_TOOL], stream=True)
    calls, finish = {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or delta.id
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [json.loads(calls[i]["arguments"]) for i in sorted(calls)] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({calls[i]["id"] for i in calls}) == 2


def test_parallel_tool_calls_false_keeps_first(server):
    reply = client(server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "weather in both cities"}],
        tools=[WEATHER_TOOL], parallel_tool_calls=False)
    assert len(reply.choices[0].message.tool_calls) == 1


# Descriptions free of the script's trigger words, so that only the user's "hi" picks the reply.
CITY_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Conditions in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def streamed_tool_calls(stream):
    """(calls as [(name, arguments)], finish_reason, content) from a streamed chat answer."""
    calls, finish, content = {}, None, ""
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, ["", ""])
            entry[0] += delta.function.name or ""
            entry[1] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return [(name, json.loads(arguments)) for name, arguments in (calls[i] for i in sorted(calls))], finish, content


def test_tool_choice_required_forces_a_call(server):
    c = client(server)
    hi = [{"role": "user", "content": "hi"}]
    # Left to itself the model answers "hi" with text ...
    free = c.chat.completions.create(model="scripted", messages=hi, tools=[CITY_TOOL, TIME_TOOL])
    assert free.choices[0].message.tool_calls is None
    # ... "required" starts the reply inside a call, so a call it is.
    forced = c.chat.completions.create(model="scripted", messages=hi, tools=[CITY_TOOL, TIME_TOOL],
                                       tool_choice="required")
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == \
        [("get_time", {"zone": "UTC"})]
    # The forced opener counts as prompt, not as generated tokens.
    opener = len(post(server, "/tokenize", {"content": "<|tool_call>call:"})["tokens"])
    assert forced.usage.prompt_tokens == free.usage.prompt_tokens + opener
    calls, finish, content = streamed_tool_calls(c.chat.completions.create(
        model="scripted", messages=hi, tools=[CITY_TOOL, TIME_TOOL], tool_choice="required", stream=True))
    assert calls == [("get_time", {"zone": "UTC"})] and finish == "tool_calls" and content == ""


def test_tool_choice_named_forces_that_function(server):
    c = client(server)
    hi = [{"role": "user", "content": "hi"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = c.chat.completions.create(model="scripted", messages=hi, tools=[TIME_TOOL, CITY_TOOL],
                                      tool_choice=named)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert reply.choices[0].finish_reason == "tool_calls"
    calls, finish, _ = streamed_tool_calls(c.chat.completions.create(
        model="scripted", messages=hi, tools=[TIME_TOOL, CITY_TOOL], tool_choice=named, stream=True))
    assert calls == [("get_weather", {"city": "Oslo"})] and finish == "tool_calls"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="scripted", messages=hi, tools=[CITY_TOOL],
                                  tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="scripted", messages=hi, tool_choice="required")


def test_tool_choice_none_prevents_calls(server):
    c = client(server)
    messages = [{"role": "user", "content": "What is the weather?"}]
    auto = c.chat.completions.create(model="scripted", messages=messages, tools=[WEATHER_TOOL])
    assert auto.choices[0].message.tool_calls  # the scripted model wants to call here
    # "none": the tools leave the prompt and the call opener cannot be sampled; the reply runs on
    # as text (the scripted engine, thrown off its script, repeats itself up to max_tokens).
    kwargs = dict(model="scripted", messages=messages, tools=[WEATHER_TOOL], tool_choice="none",
                  temperature=0, max_tokens=24)
    reply = c.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert choice.message.model_extra["reasoning_content"].startswith("The user wants the weather.")
    assert "get_weather" not in (choice.message.content or "")
    assert reply.usage.prompt_tokens < auto.usage.prompt_tokens  # no tool declarations
    calls, finish, _ = streamed_tool_calls(c.chat.completions.create(**kwargs, stream=True))
    assert calls == [] and finish == "length"


def test_stop_sequences(server):
    c = client(server)
    reply = c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "tell a story"}], stop=["THE END"])
    assert reply.choices[0].message.content == "Once upon a time there was a dragon."
    assert reply.choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "tell a story"}],
                                       stop="dragon", stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == "Once upon a time there was a"


def test_max_tokens_gives_length(server):
    reply = client(server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "tell a story"}], max_completion_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3


def test_logprobs(server):
    reply = client(server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2, temperature=0)
    entries = reply.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == "Hello there! How can I help?"
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)


def test_completions_endpoint(server):
    c = client(server)
    reply = c.completions.create(model="scripted", prompt="<|turn>user\ntell a story<turn|>\n<|turn>model\n", max_tokens=50)
    assert reply.choices[0].text.startswith("Once upon a time")
    assert reply.choices[0].finish_reason == "stop"
    stream = c.completions.create(model="scripted", prompt="hi", stream=True, max_tokens=4)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(ch.choices[0].text for ch in chunks) == "Hello there! How"


def test_tokenize_round_trip(server):
    tokens = post(server, "/tokenize", {"content": "Hello world"})["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    assert post(server, "/detokenize", {"tokens": tokens})["content"] == "Hello world"


def test_sixteen_concurrent_streams(server):
    results, errors = [None] * 16, []

    def run(i):
        try:
            prompt = "tell a story" if i % 2 else "hi"
            stream = client(server).chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": f"{prompt} #{i}"}], stream=True)
            results[i] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for i, text in enumerate(results):
        expected = "Once upon a time there was a dragon. THE END and then more text." if i % 2 else "Hello there! How can I help?"
        assert text == expected


def test_cancellation_frees_the_slot(slow_server):
    stream = client(slow_server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "go on forever"}], stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert slow_server.metric("gemma4_requests_running") == 1
    stream.close()  # the client disconnects
    deadline = time.time() + 5
    while slow_server.metric("gemma4_requests_running") != 0 and time.time() < deadline:
        time.sleep(0.05)
    assert slow_server.metric("gemma4_requests_running") == 0
    assert slow_server.metric("gemma4_sequences_cached") == 0  # cancelled KV is not kept


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go on forever"}]}),
    ("/v1/completions", {"prompt": "go on forever"}),
])
def test_non_streamed_disconnect_cancels(slow_server, path, body):
    """A client that gives up on a non-streamed answer (nothing is written until the end) is
    noticed while generating: its slot and KV are freed long before the 400-token reply ends."""
    disconnected = slow_server.metric("gemma4_requests_disconnected_total")
    payload = json.dumps({"model": "scripted", **body}).encode()
    sock = socket.create_connection(("127.0.0.1", slow_server.port), timeout=5)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    deadline = time.time() + 5
    while slow_server.metric("gemma4_requests_running") != 1 and time.time() < deadline:
        time.sleep(0.02)
    assert slow_server.metric("gemma4_requests_running") == 1
    sock.close()
    closed = time.time()
    while slow_server.metric("gemma4_requests_running") != 0 and time.time() < closed + 5:
        time.sleep(0.02)
    assert slow_server.metric("gemma4_requests_running") == 0
    assert time.time() - closed < 2  # generating all 400 tokens takes 8 s at 20 ms a step
    assert slow_server.metric("gemma4_sequences_cached") == 0  # cancelled KV is not kept
    deadline = time.time() + 2
    while slow_server.metric("gemma4_requests_disconnected_total") != disconnected + 1 and time.time() < deadline:
        time.sleep(0.02)
    assert slow_server.metric("gemma4_requests_disconnected_total") == disconnected + 1
    assert slow_server.alive()


def test_queue_full_returns_429(slow_server):
    c = client(slow_server)
    running = c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "forever a"}], stream=True)
    next(iter(running))
    queued_result = {}

    def queued():
        try:
            queued_result["stream"] = c.chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": "forever b"}], stream=True)
        except Exception as error:  # noqa: BLE001
            queued_result["error"] = error

    thread = threading.Thread(target=queued)
    thread.start()
    deadline = time.time() + 5
    while slow_server.metric("gemma4_requests_waiting") < 1 and time.time() < deadline:
        time.sleep(0.02)
    with pytest.raises(openai.RateLimitError) as refused:
        c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.response.headers.get("retry-after") == "1"
    running.close()
    thread.join(10)
    if "stream" in queued_result:
        queued_result["stream"].close()
    assert slow_server.alive()


def test_api_key_required(tmp_path_factory):
    from conftest import scripted_server
    srv = scripted_server(tmp_path_factory, "keyed", extra=["--api-key", "sekret"])
    try:
        with pytest.raises(openai.AuthenticationError):
            client(srv).models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert good.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}]).choices
        assert srv.get("/health")[0] == 200  # health stays public
    finally:
        srv.stop()


def test_cors_preflight(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: http://example.com\r\n"
                 b"Access-Control-Request-Method: POST\r\nConnection: close\r\n\r\n")
    response = b""
    while chunk := sock.recv(4096):
        response += chunk
    sock.close()
    head = response.decode(errors="replace").lower()
    assert head.startswith("http/1.1 204")
    assert "access-control-allow-origin: *" in head
    assert "access-control-allow-headers: authorization, content-type" in head
