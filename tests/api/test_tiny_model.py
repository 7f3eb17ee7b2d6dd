"""The same flows once on a real (tiny, synthetic, random-weight) model on the CPU engine: the
output is noise, so these check wiring, shapes, determinism and concurrency, not text."""
import threading

import openai


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_alias(tiny_server):
    assert [m.id for m in client(tiny_server).models.list().data] == ["tiny"]


def test_chat_and_usage(tiny_server):
    reply = client(tiny_server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert 0 < reply.usage.completion_tokens <= 8
    assert reply.model_extra["timings"]["predicted_n"] == reply.usage.completion_tokens


def test_streaming_matches_non_streaming_greedy(tiny_server):
    c = client(tiny_server)
    messages = [{"role": "user", "content": "Count to three"}]
    whole = c.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="Once upon", max_tokens=8, temperature=0, stream=True))
    assert streamed == whole.choices[0].text
    reply = c.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    stream = c.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == (reply.choices[0].message.content or "")


def test_seed_reproducible(tiny_server):
    c = client(tiny_server)
    def sample(seed):
        return c.completions.create(model="tiny", prompt="The sky is", max_tokens=12, temperature=1.0,
                                    top_p=1.0, seed=seed, logprobs=1).choices[0].logprobs.tokens
    assert sample(7) == sample(7)
    assert any(sample(s) != sample(7) for s in (8, 9, 10))


def test_stop_and_max_tokens(tiny_server):
    reply = client(tiny_server).completions.create(model="tiny", prompt="a b c", max_tokens=5, temperature=0)
    assert reply.usage.completion_tokens <= 5


def test_concurrent_streams_complete(tiny_server):
    c = client(tiny_server)
    expected = c.completions.create(model="tiny", prompt="Hi", max_tokens=6, temperature=0).choices[0].text
    results, errors = [None] * 8, []

    def run(i):
        try:
            stream = c.completions.create(model="tiny", prompt="Hi", max_tokens=6, temperature=0, stream=True)
            results[i] = "".join(ch.choices[0].text for ch in stream)
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert results == [expected] * 8  # batching does not change greedy output


def test_synthetic_model_is_announced(tiny_server):
    """`gemma4 synth` marks its checkpoints; serve says so in its log and /v1/models (the web UI
    shows the flag from there)."""
    (entry,) = client(tiny_server).models.list().data
    assert entry.model_extra["synthetic"] is True
    assert "[synthetic: output is noise]" in tiny_server.log_path.read_text()


def test_tool_choice_named_forces_the_opener(tiny_server):
    """Wiring on the real engine: a named tool_choice appends the call opener to the prompt (the
    random model's continuation is noise, so only the shape and the accounting are checked)."""
    import json
    import urllib.request

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    c = client(tiny_server)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    free = c.chat.completions.create(model="tiny", messages=messages, tools=[weather], max_tokens=4, temperature=0)
    named = c.chat.completions.create(model="tiny", messages=messages, tools=[weather], max_tokens=4, temperature=0,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    request = urllib.request.Request(tiny_server.url + "/tokenize", method="POST",
                                     data=json.dumps({"content": "<|tool_call>call:get_weather{"}).encode())
    with urllib.request.urlopen(request, timeout=10) as response:
        opener = len(json.loads(response.read())["tokens"])
    assert named.usage.prompt_tokens == free.usage.prompt_tokens + opener
    choice = named.choices[0]
    for call in choice.message.tool_calls or []:
        assert call.function.name == "get_weather"
    # Four random tokens rarely close the call: then it is cut off, which is a "length" finish.
    assert choice.finish_reason in ("length", "tool_calls")
