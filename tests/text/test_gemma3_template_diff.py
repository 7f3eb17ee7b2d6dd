"""Differential test: `gemma4 template` on Gemma 3's chat template against Python Jinja2.

tests/text/data/gemma3-chat-template.jinja is the `chat_template` of Google's Gemma 3 instruction
checkpoints (google/gemma-3-*-it, tokenizer_config.json), the template the Gemma 3 270M demo model
was trained for (its GGUF carries none). gemma4 recognises it (ChatTemplate variant gemma3) and
renders it natively; Jinja2 is set up the way transformers' apply_chat_template does it.

1,500 conversations with a fixed seed: optional system message (string, or parts), alternating
user/assistant turns (sometimes broken on purpose: Jinja raises, gemma4 must refuse), content as
strings with whitespace to trim or as lists of text/image/other parts, a missing or null content,
a system message mid-chat, tools and thinking kwargs (which the template ignores),
add_generation_prompt both ways. Byte-for-byte equal prompts, or errors on both sides.
gemma4 also refuses, on purpose, some input Jinja renders silently (roles other than system /
user / assistant, parts that are not objects, non-string texts); the generator avoids those and
test_client_mistakes_are_refused checks them.
"""

import random
from pathlib import Path

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from template_cli import render_with_gemma4

SEED = 20261130
CONVERSATIONS = 1_500
TEMPLATE = Path(__file__).resolve().parent / "data" / "gemma3-chat-template.jinja"

TEXTS = ["Hi", "What is the capital of France?", "  padded  ", "\n\nnewlines\n", "tabs\tinside",
         "ünïcödé ✓ 東京 😊", "", " ", "\u3000ideographic space\u3000", "\xa0nbsp\xa0",
         "multi\nline", "<start_of_turn>look-alike", "<end_of_turn>", "trailing\u2029", "\x0bvt",
         "\x1c\x1dseparators\x1e\x1f", "\u2028line sep", "\u200bzero width\u200b", "x" * 30]


def hf_environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env


def random_text(rng):
    text = rng.choice(TEXTS)
    return text + rng.choice(TEXTS) if rng.random() < 0.3 else text


def random_parts(rng):
    parts = []
    for _ in range(rng.randint(0, 4)):
        kind = rng.random()
        if kind < 0.6:
            parts.append({"type": "text", "text": random_text(rng)})
        elif kind < 0.75:
            parts.append({"type": "image"})
        elif kind < 0.85:
            parts.append({"type": "image_url", "image_url": {"url": "data:,"}})
        elif kind < 0.92:
            parts.append({"type": "text"})  # no text: renders nothing
        else:
            parts.append({"kind": "text", "text": "no type"})
    return parts


def random_content(rng):
    kind = rng.random()
    if kind < 0.65:
        return random_text(rng)
    if kind < 0.9:
        return random_parts(rng)
    return None  # Jinja: "Invalid content type"


def random_message(rng, role):
    message = {"role": role}
    if rng.random() < 0.97:
        message["content"] = random_content(rng)
    if role == "assistant" and rng.random() < 0.1:
        message["reasoning_content"] = "ignored by the template"
    return message


def random_conversation(rng):
    messages = []
    if rng.random() < 0.4:
        system = {"role": "system"}
        kind = rng.random()
        if kind < 0.7:
            system["content"] = random_text(rng)
        elif kind < 0.9:
            system["content"] = [{"type": "text", "text": random_text(rng)}] + random_parts(rng)
        else:
            system["content"] = rng.choice([None, [], [{"type": "image"}]])  # Jinja raises
        messages.append(system)
    turns = rng.choice([0, 1, 1, 2, 3, 4, 5])
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        if rng.random() < 0.04:
            role = {"user": "assistant", "assistant": rng.choice(["user", "system"])}[role]
        messages.append(random_message(rng, role))
    kwargs = {"bos_token": "<bos>", "add_generation_prompt": rng.random() < 0.7}
    if rng.random() < 0.2:
        kwargs["enable_thinking"] = rng.random() < 0.5
    tools = None
    if rng.random() < 0.1:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    return {"messages": messages, "tools": tools, "kwargs": kwargs}


def render_reference(template, request):
    kwargs = dict(request["kwargs"])
    try:
        return template.render(messages=request["messages"], tools=request["tools"],
                               documents=None, **kwargs), None
    except Exception as error:  # noqa: BLE001 - any Jinja failure means "invalid input"
        return None, f"{type(error).__name__}: {error}"


def render_ours(requests):
    return render_with_gemma4(TEMPLATE, requests)


def test_random_conversations_match_jinja():
    template = hf_environment().from_string(TEMPLATE.read_text())
    rng = random.Random(SEED)
    requests = [random_conversation(rng) for _ in range(CONVERSATIONS)]
    responses = render_ours(requests)
    mismatches = []
    rendered = refused = 0
    for index, (request, response) in enumerate(zip(requests, responses)):
        expected, reference_error = render_reference(template, request)
        if reference_error is not None:
            refused += 1
            if "error" not in response:
                mismatches.append((index, f"jinja raised {reference_error}, gemma4 rendered"))
            continue
        rendered += 1
        if "error" in response:
            mismatches.append((index, f"gemma4 refused: {response['error']}"))
        elif response["prompt"] != expected or response["variant"] != "gemma3":
            mismatches.append((index, f"expected {expected!r}, got {response['prompt']!r}"))
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:3]}"
    assert rendered > CONVERSATIONS // 2 and refused > 50, (rendered, refused)


@pytest.mark.parametrize("messages", [
    [{"role": "tool", "content": "x"}],
    [{"role": "user", "content": "a"}, {"role": "developer", "content": "b"}],
    [{"role": "user", "content": ["just a string part"]}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": {"type": "text", "text": "an object, not a list"}}],
    [],
])
def test_client_mistakes_are_refused(messages):
    response = render_ours([{"messages": messages, "kwargs": {"add_generation_prompt": True}}])[0]
    assert "error" in response and "prompt" not in response
