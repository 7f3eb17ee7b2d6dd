"""Differential test: `gemma4 template` against Python Jinja2 rendering the official templates.

The reference is set up the way transformers' apply_chat_template does it
(transformers/utils/chat_template_utils.py): an ImmutableSandboxedEnvironment with
trim_blocks=True, lstrip_blocks=True and the loopcontrols extension, a `tojson` filter that is
plain json.dumps (no HTML escaping), the globals raise_exception (raises TemplateError) and
strftime_now, and render(messages=..., tools=..., documents=None, add_generation_prompt=...,
**kwargs) where kwargs carry the tokenizer's special tokens (bos_token "<bos>", eos_token, ...).
HF's `{% generation %}` extension is left out: neither Gemma 4 template uses it.

2,000 conversations are generated with a fixed seed (random roles incl. developer/system mid-chat,
content parts, tools with nested JSON schemas incl. union types / anyOf / free-form objects, tool
loops with and without ids, parallel calls, legacy tool_responses, reasoning replay, adjacent
assistant messages, thinking on/off, preserve_thinking, add_generation_prompt both ways, keys that
collide case-insensitively, floats in every repr range), each rendered with both variants, and
compared byte for byte. Tool-call arguments are sometimes given as JSON strings (OpenAI shape):
our renderer decodes them itself, the reference gets them decoded (the template requires
objects, as the spec says the server must decode them). Where Jinja raises, gemma4 must answer an
error too.
"""

import json
import os
import random
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from template_cli import render_with_gemma4

SEED = 20260709
CONVERSATIONS = 2_000

SHARED_DATA = Path(os.environ.get("GEMMA4_SHARED_DATA",
                                  Path(__file__).resolve().parents[3] / "shared" / "data"))
TEMPLATES = {variant: SHARED_DATA / "chat-templates" / f"gemma4-{variant}.jinja"
             for variant in ("compact", "full")}
SPECIAL_TOKENS = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                  "unk_token": "<unk>", "mask_token": "<mask>"}


def hf_environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# ---------------------------------------------------------------- random conversations

TEXTS = ["Hi", "Hello! How can I help?", "Tell me a joke.", "  padded  ", "\n\nnewlines\n",
         "tabs\tinside", "ünïcödé ✓ 東京 😊", "quotes \"double\" and 'single'", "C:\\temp\\new",
         "braces {x}, y: z [1,2]", "", " ", "\u3000ideographic space\u3000", "\xa0nbsp\xa0",
         "multi\nline\ntext", "a<b>c", "<|turn>look-alike", "emoji 👨‍👩‍👧‍👦", "x" * 40,
         "trailing\u2029", "\x0bvt", "value: 42, other: 7"]
THINKING_FRAGMENTS = ["<|channel>thought\nhidden<channel|>", "<|channel>unterminated",
                      "stray<channel|>", "<|channel>a<channel|>b<|channel>c<channel|>"]
KEYS = ["city", "Zeta", "alpha", "Alpha", "ALPHA", "b_1", "a-b", "_x", "x.y", "éclair", "Éclair",
        "Ωmega", "ωmega", "Ключ", "ключ", "ÿ", "Ÿ", "Straße", "n", "value", "type", "description",
        "my key", "$ref", "9lives"]
FLOATS = [0.0, -0.0, 1.0, 2.5, 100.0, 0.1, 1e-05, 1e-7, 0.0001, 1e16, 1e15, 1.5e16, 1e22,
          123456789.123, 1234567890123456.0, 3.141592653589793, -2.75, 1e300, 5e-324, 2.0 ** 60]
INTS = [0, 1, -1, 42, -678, 1000, 2 ** 53 + 1, 2 ** 62, -2 ** 63]
NAMES = ["get_weather", "bash", "read", "search.web", "send-mail", "f", "lookup_2"]
TYPES = ["string", "integer", "number", "boolean", "array", "object"]


def random_text(rng):
    text = rng.choice(TEXTS)
    if rng.random() < 0.3:
        text += rng.choice(TEXTS)
    return text


def random_scalar(rng):
    kind = rng.randrange(6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice(INTS)
    if kind == 3:
        return rng.choice(FLOATS) * rng.choice([1, -1])
    return random_text(rng)


def random_value(rng, depth=0):
    if depth >= 3 or rng.random() < 0.6:
        return random_scalar(rng)
    if rng.random() < 0.5:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(KEYS): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def random_type(rng):
    roll = rng.random()
    if roll < 0.08:
        return [rng.choice(TYPES), "null"]
    if roll < 0.12:
        return rng.choice(["STRING", "Object", "ARRAY"])
    return rng.choice(TYPES)


def random_schema(rng, depth=0):
    schema = {}
    if rng.random() < 0.05:
        return {"anyOf": [{"type": "string"}, {"type": "number"}],
                **({"description": random_text(rng)} if rng.random() < 0.5 else {})}
    if rng.random() < 0.03:
        return rng.choice(["not-a-schema", 5, None, [1, 2], True])
    kind = random_type(rng) if depth < 3 else rng.choice(["string", "integer", "boolean"])
    schema["type"] = kind
    if rng.random() < 0.6:
        schema["description"] = random_text(rng)
    if rng.random() < 0.15:
        schema["nullable"] = rng.choice([True, False, 1])
    if kind == "string" and rng.random() < 0.4:
        schema["enum"] = rng.sample(["economy", "business", "first", "é", 3, "a b"], rng.randint(1, 3))
    if isinstance(kind, str) and kind.lower() == "array" and rng.random() < 0.85:
        items = random_schema(rng, depth + 1)
        if isinstance(items, dict) and rng.random() < 0.3:
            extra = rng.choice([{"additionalProperties": False}, {"default": {"mode": "auto"}},
                                {"minItems": 1}, {"required": ["a", "b"]}, {"nullable": None},
                                {"type": ["string", "integer"]}, {"format": None}])
            items.update(extra)
        schema["items"] = items
    if isinstance(kind, str) and kind.lower() == "object":
        roll = rng.random()
        if roll < 0.6:
            schema["properties"] = random_properties(rng, depth + 1)
            if schema["properties"] and rng.random() < 0.6:
                schema["required"] = rng.sample(sorted(schema["properties"]),
                                                rng.randint(1, len(schema["properties"])))
        elif roll < 0.75:
            schema["additionalProperties"] = rng.choice([True, False, {"type": "string"}])
        elif roll < 0.8:
            schema["properties"] = None
    return schema


def random_properties(rng, depth):
    return {rng.choice(KEYS): random_schema(rng, depth) for _ in range(rng.randrange(5))}


def random_tool(rng):
    function = {"name": rng.choice(NAMES)}
    if rng.random() < 0.85:
        function["description"] = random_text(rng)
    roll = rng.random()
    if roll < 0.8:
        parameters = {"type": "object", "properties": random_properties(rng, 0)}
        if parameters["properties"] and rng.random() < 0.6:
            parameters["required"] = rng.sample(sorted(parameters["properties"]),
                                                rng.randint(1, len(parameters["properties"])))
        if rng.random() < 0.05:
            del parameters["type"]  # the template then leaves `parameters:{` unbalanced
        function["parameters"] = parameters
    elif roll < 0.9:
        function["parameters"] = {}
    if rng.random() < 0.1:
        function["response"] = rng.choice([{"type": "object", "description": "Result"},
                                           {"type": "string"}, {"description": "only"}, None])
    return {"type": "function", "function": function}


def random_content(rng, role):
    roll = rng.random()
    if roll < 0.1:
        return None
    if roll < 0.75:
        text = random_text(rng)
        if role == "assistant" and rng.random() < 0.25:
            text = rng.choice(THINKING_FRAGMENTS) + text
        return text
    parts = []
    for _ in range(rng.randrange(1, 4)):
        kind = rng.choice(["text", "text", "image", "image_url", "audio", "input_audio", "video",
                           "file"])
        if kind == "text":
            text = random_text(rng)
            if role == "assistant" and rng.random() < 0.2:
                text = rng.choice(THINKING_FRAGMENTS) + text
            parts.append({"type": "text", "text": text})
        else:
            parts.append({"type": kind})
    return parts


def random_tool_calls(rng, call_ids):
    calls = []
    for _ in range(rng.randint(1, 3)):
        arguments = {rng.choice(KEYS): random_value(rng) for _ in range(rng.randrange(4))}
        call = {"type": "function", "function": {"name": rng.choice(NAMES)}}
        roll = rng.random()
        if roll < 0.3:
            call["function"]["arguments"] = json.dumps(arguments)  # OpenAI wire shape
        elif roll < 0.35:
            call["function"]["arguments"] = None
        else:
            call["function"]["arguments"] = arguments
        if rng.random() < 0.8:
            call["id"] = f"call_{len(call_ids)}"
            call_ids.append(call["id"])
        calls.append(call)
    return calls


def random_tool_result(rng, calls):
    message = {"role": "tool"}
    ids = [call.get("id") for call in calls]
    roll = rng.random()
    if roll < 0.7 and any(ids):
        message["tool_call_id"] = rng.choice([i for i in ids if i])
    elif roll < 0.8:
        message["tool_call_id"] = "call_unknown"
    if rng.random() < 0.4:
        message["name"] = rng.choice(NAMES + [""])
    roll = rng.random()
    if roll < 0.7:
        message["content"] = rng.choice([random_text(rng), '{"temp_c": 18, "sky": "sunny"}'])
    elif roll < 0.85:
        message["content"] = [{"type": "text", "text": random_text(rng)}] + (
            [{"type": "image"}] if rng.random() < 0.5 else []) + (
            [{"type": "text", "text": "more"}] if rng.random() < 0.5 else [])
    else:
        message["content"] = rng.choice([None, 42, 2.5, True])
    return message


def random_assistant(rng, call_ids, messages):
    message = {"role": "assistant"}
    if rng.random() < 0.35:
        message[rng.choice(["reasoning_content", "reasoning_content", "reasoning"])] = \
            rng.choice(["I should call a tool.", "Simple arithmetic.", "", "  spaced  "])
    with_calls = rng.random() < 0.45
    if with_calls:
        message["tool_calls"] = random_tool_calls(rng, call_ids)
        if rng.random() < 0.6:
            message["content"] = random_content(rng, "assistant")
    else:
        message["content"] = random_content(rng, "assistant")
    if with_calls and rng.random() < 0.07:
        message["tool_responses"] = [
            {"name": rng.choice(NAMES + [""]),
             "response": rng.choice([{"temperature": 15, "weather": "sunny"}, "text", None])}
            for _ in range(rng.randint(1, 2))]
    messages.append(message)
    if with_calls and rng.random() < 0.8:
        for _ in range(rng.randint(1, len(message["tool_calls"]) + 1)):
            messages.append(random_tool_result(rng, message["tool_calls"]))


def random_conversation(rng):
    messages = []
    call_ids = []
    if rng.random() < 0.4:
        role = rng.choice(["system", "system", "developer"])
        content = random_text(rng) if rng.random() < 0.7 else [
            {"type": "text", "text": random_text(rng)} for _ in range(rng.randint(1, 3))]
        messages.append({"role": role, "content": content})
    for _ in range(rng.randrange(0, 7)):
        roll = rng.random()
        if roll < 0.4:
            messages.append({"role": "user", "content": random_content(rng, "user")})
        elif roll < 0.85:
            random_assistant(rng, call_ids, messages)
        elif roll < 0.92:
            messages.append({"role": rng.choice(["system", "developer"]),
                             "content": random_text(rng)})
        else:
            messages.append(random_tool_result(rng, []))  # orphan tool result: dropped
    tools = None
    roll = rng.random()
    if roll < 0.5:
        tools = [random_tool(rng) for _ in range(rng.randint(1, 3))]
    elif roll < 0.55:
        tools = []
    kwargs = dict(SPECIAL_TOKENS)
    kwargs["add_generation_prompt"] = rng.random() < 0.7
    if rng.random() < 0.8:
        kwargs["enable_thinking"] = rng.random() < 0.5
    if rng.random() < 0.2:
        kwargs["preserve_thinking"] = rng.random() < 0.5
    return {"messages": messages, "tools": tools, "kwargs": kwargs}


def decoded_for_jinja(request):
    """The template takes tool-call arguments as objects: decode JSON-string arguments."""
    messages = json.loads(json.dumps(request["messages"]))
    for message in messages:
        for call in message.get("tool_calls") or []:
            arguments = call["function"].get("arguments")
            if isinstance(arguments, str):
                call["function"]["arguments"] = json.loads(arguments)
    return messages


def render_reference(template, request):
    kwargs = dict(request["kwargs"])
    add_generation_prompt = kwargs.pop("add_generation_prompt", False)
    try:
        return template.render(messages=decoded_for_jinja(request), tools=request["tools"],
                               documents=None, add_generation_prompt=add_generation_prompt,
                               **kwargs), None
    except Exception as error:  # noqa: BLE001 - any Jinja failure means "invalid input"
        return None, f"{type(error).__name__}: {error}"


def render_ours(variant, requests):
    return render_with_gemma4(TEMPLATES[variant], requests)


def conversations():
    rng = random.Random(SEED)
    return [random_conversation(rng) for _ in range(CONVERSATIONS)]


@pytest.mark.parametrize("variant", ["compact", "full"])
def test_random_conversations_match_jinja(variant):
    requests = conversations()
    template = hf_environment().from_string(TEMPLATES[variant].read_text())
    responses = render_ours(variant, requests)
    mismatches = []
    rendered = 0
    for index, (request, response) in enumerate(zip(requests, responses)):
        expected, reference_error = render_reference(template, request)
        if reference_error is not None:
            if "error" not in response:
                mismatches.append((index, f"jinja raised {reference_error}, gemma4 rendered"))
            continue
        rendered += 1
        if "error" in response:
            mismatches.append((index, f"gemma4 refused: {response['error']}"))
        elif response["prompt"] != expected:
            mismatches.append((index, f"prompt differs:\n  ours {response['prompt']!r}\n"
                                      f"  jinja {expected!r}"))
    assert not mismatches, (f"{len(mismatches)} of {len(requests)} differ; first: "
                            f"{json.dumps(requests[mismatches[0][0]])}\n{mismatches[0][1]}")
    assert rendered >= 0.9 * len(requests)  # the generator must mostly produce valid chats


def test_spec_vectors_match_jinja_and_gemma4():
    vectors = json.loads((SHARED_DATA.parent / "spec" / "gemma4-chat-vectors.json").read_text())
    env = hf_environment()
    for case in vectors["render"]:
        request = {"messages": case["messages"], "tools": case["tools"], "kwargs": case["kwargs"]}
        template = env.from_string(TEMPLATES[case["variant"]].read_text())
        expected, error = render_reference(template, request)
        assert error is None and expected == case["expected_prompt"], case["name"]
        [response] = render_ours(case["variant"], [request])
        assert response.get("prompt") == case["expected_prompt"], case["name"]


@pytest.mark.parametrize("bad_request", [
    {"messages": [{"role": "robot", "content": "x"}]},
    {"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "not json"}}]}]},
    {"messages": [{"role": "user", "content": "x"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {
         "type": "object", "properties": ["not", "a", "mapping"]}}}]},
    {"messages": "not a list"},
])
def test_invalid_requests_are_errors(bad_request):
    [response] = render_ours("compact", [bad_request])
    assert "error" in response and "prompt" not in response
