"""`gemma4 run` with text prompts on a tiny synthetic checkpoint: the prompt ids must be those of
the reference (Jinja2 rendering the checkpoint's chat_template.jinja as HF apply_chat_template
does, then HF `tokenizers`), and greedy generation from them must give the same ids as
`run --prompt-ids` with those ids, printed as the HF-decoded text up to the first stop token."""
import os
import subprocess
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from test_chat_template_diff import SHARED_DATA, SPECIAL_TOKENS, TEMPLATES, hf_environment

TOKENIZER = SHARED_DATA / "tokenizer" / "tokenizer.json"
STOP_IDS = {1, 106, 50}  # spec gemma4-chat-format.md: <eos>, <turn|>, <|tool_response>
GREEDY = ["--temperature", "0", "-n", "12"]


def binary():
    path = os.environ.get("GEMMA4_BIN")
    if not path or not Path(path).exists():
        pytest.skip("GEMMA4_BIN is not set to a built gemma4 binary")
    return path


def synth(directory, with_tokenizer=True):
    extra = ["--tokenizer", str(TOKENIZER), "--chat-template", str(TEMPLATES["compact"])] if with_tokenizer else []
    subprocess.run([binary(), "synth", "--config", "tiny", "--format", "bf16", "--seed", "1",
                    "-o", str(directory), *extra], check=True, capture_output=True)
    return directory


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("run-prompt") / "model")


def run(model, *args):
    return subprocess.run([binary(), "run", "-m", str(model), *args], capture_output=True, text=True,
                          timeout=300)


def ids_after(label, text):
    line = next(line for line in text.splitlines() if line.startswith(label))
    value = line[len(label):].strip()
    return [int(x) for x in value.split(",")] if value else []


def reference_chat_ids(content, enable_thinking):
    prompt = hf_environment().from_string(TEMPLATES["compact"].read_text()).render(
        messages=[{"role": "user", "content": content}], tools=None, documents=None,
        add_generation_prompt=True, enable_thinking=enable_thinking, **SPECIAL_TOKENS)
    return Tokenizer.from_file(str(TOKENIZER)).encode(prompt, add_special_tokens=False).ids


def reference_raw_ids(text):
    return [2] + Tokenizer.from_file(str(TOKENIZER)).encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("flags, expected_prompt", [
    ([], lambda: reference_chat_ids("Hello", False)),
    (["--think"], lambda: reference_chat_ids("Hello", True)),
    (["--raw"], lambda: reference_raw_ids("Hello")),
])
def test_text_prompt_generates_like_prompt_ids(tiny_model, flags, expected_prompt):
    text_run = run(tiny_model, "-p", "Hello", *flags, "--print-ids", *GREEDY)
    assert text_run.returncode == 0, text_run.stderr
    prompt = ids_after("prompt ids:", text_run.stderr)
    assert prompt == expected_prompt()

    ids_run = run(tiny_model, "--prompt-ids", ",".join(map(str, prompt)), "--ignore-eos", *GREEDY)
    assert ids_run.returncode == 0, ids_run.stderr
    all_ids = [int(x) for x in ids_run.stdout.strip().split(",")]
    stop = next((i for i, token in enumerate(all_ids) if token in STOP_IDS), len(all_ids))
    expected_generated = all_ids[:stop + 1]
    assert ids_after("generated ids:", text_run.stderr) == expected_generated
    expected_text = Tokenizer.from_file(str(TOKENIZER)).decode(all_ids[:stop], skip_special_tokens=False)
    assert text_run.stdout == expected_text + "\n"


def test_messages_file_matches_single_prompt(tiny_model, tmp_path):
    messages = tmp_path / "messages.json"
    messages.write_text('[{"role": "user", "content": "Hello"}]')
    from_file = run(tiny_model, "--messages", str(messages), "--print-ids", *GREEDY)
    assert from_file.returncode == 0, from_file.stderr
    assert ids_after("prompt ids:", from_file.stderr) == reference_chat_ids("Hello", False)


def test_look_alike_in_prompt_stays_text(tiny_model):
    result = run(tiny_model, "-p", "<|turn>", "--print-ids", "-n", "1")
    assert result.returncode == 0, result.stderr
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    tokenizer.encode_special_tokens = True
    user_ids = tokenizer.encode("<|turn>", add_special_tokens=False).ids
    prompt = ids_after("prompt ids:", result.stderr)
    assert prompt.count(105) == 2  # the user turn and the model turn the template opens
    assert any(prompt[i:i + len(user_ids)] == user_ids for i in range(len(prompt)))


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    model = synth(tmp_path / "bare", with_tokenizer=False)
    result = run(model, "-p", "Hello", "-n", "1")
    assert result.returncode != 0
    assert "tokenizer" in result.stderr and "tokenizer.json" in result.stderr


def test_bad_option_combinations_are_errors(tiny_model):
    for args in (["-p", "x", "--prompt-ids", "2"], ["--raw", "--think", "-p", "x"], []):
        result = run(tiny_model, *args, "-n", "1")
        assert result.returncode != 0 and "gemma4 run:" in result.stderr, args
