"""Differential test: `gemma4 tokenize` against the HF `tokenizers` library.

Generates 12,000 strings with a fixed seed (unicode from many scripts, emoji sequences,
whitespace runs, newlines, special-token look-alikes, long words, '▁', invalid UTF-8) and checks
  * encode: our ids == HF ids, with special tokens parsed (HF `encode(text,
    add_special_tokens=False)`) and not parsed (HF with `encode_special_tokens = True`);
  * decode: our text == HF `decode(ids)` on every id list HF produced;
  * round trip: decode(encode(x)) == x for valid UTF-8 without U+2581.

Invalid UTF-8. Python strings (and so HF's API) cannot hold invalid UTF-8, and JSON strings
cannot either, so such inputs travel to our binary as {"text_base64": ...}. The reference ids are
derived from HF: the bytes are split the way a strict UTF-8 decoder sees them (Python's
"surrogateescape" marks each byte that does not start a well-formed sequence); every valid run
is encoded by HF and every invalid byte becomes HF's <0xNN> token. That equals HF's own
algorithm applied to a "character" it cannot look up (byte fallback), and it is exact because
no merge involves a byte token (checked below), so a byte token splits BPE like a wall.
"""

import base64
import json
import os
import random
import subprocess
from pathlib import Path

import pytest
from tokenizers import Tokenizer

SEED = 20260402
CASES = 12_000

SHARED_DATA = Path(os.environ.get("GEMMA4_SHARED_DATA",
                                  Path(__file__).resolve().parents[3] / "shared" / "data"))
TOKENIZER_JSON = SHARED_DATA / "tokenizer" / "tokenizer.json"

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|tool>", "<tool|>", "<|tool_call>",
            "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|think|>",
            "<|channel>", "<channel|>", "<|turn>", "<turn|>", "<|image>", "<|audio>",
            "<|image|>", "<|audio|>", "<image|>", "<audio|>", "<|video|>"]
LOOKALIKES = ["<|turn", "|turn>", "<|turn|>", "<<|turn>>", "< |turn>", "<|TURN>", "<start_of_turn>",
              "<end_of_turn>", "<unused5>", "<0x41>", "<0x0A>", "<|", "|>", "<", ">", "<|tool_",
              "<table>", "</s>", "<s>", "[multimodal]", "<|im_start|>", "<|\"", "<tool_call|",
              "<|channel>thought\n", "<bos><bos>"]
RANGES = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF),
          (0x590, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F),
          (0x2190, 0x2BFF), (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xE000, 0xE0FF),
          (0xFE00, 0xFFFD), (0x1F300, 0x1FAFF), (0x10000, 0x1007F), (0x20000, 0x2A6DF),
          (0xE0000, 0xE007F), (0x10FF00, 0x10FFFF)]
WORDS = ["the", "Hello", "world", "tokenizer", "def", "return", "naïve", "Straße", "東京", "привет",
         "مرحبا", "नमस्ते", "こんにちは", "3.14159", "2026-04-02", "http://example.com/a?b=c",
         "{\"k\": [1, 2]}", "call:get_weather{city:", "thought", "user", "model", "\u2581", "▁▁",
         "<td> </td>", "a> </b", ">  </", "\n>\n </"]
EMOJI = ["😊", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "🏳️‍🌈", "❤️", "🫠", "✈︎", "1️⃣", "🧑🏿‍🚀"]
WHITESPACE = [" ", "  ", "\t", "\n", "\r\n", "\n\n", "\u3000", "\u00a0", "\u2009", "\x0b", "\x0c"]
INVALID = [b"\x80", b"\xbf", b"\xc0\xaf", b"\xc1\x81", b"\xe0\x80\xaf", b"\xed\xa0\x80",
           b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5", b"\xff", b"\xfe", b"\xe4\xbd",
           b"\xf0\x9f\x98", b"\xc3", b"\xf0\x9f", b"\xe2\x96"]


def random_char(rng):
    low, high = rng.choice(RANGES)
    return chr(rng.randint(low, high))


def random_piece(rng):
    kind = rng.random()
    if kind < 0.30:
        return "".join(random_char(rng) for _ in range(rng.randint(1, 8)))
    if kind < 0.45:
        return rng.choice(WORDS)
    if kind < 0.55:
        return rng.choice(EMOJI)
    if kind < 0.70:
        return rng.choice(WHITESPACE) * rng.choice([1, 1, 2, 3, 5, 17, 31, 32, 33, 64])
    if kind < 0.78:
        return rng.choice(SPECIALS)
    if kind < 0.86:
        return rng.choice(LOOKALIKES)
    if kind < 0.90:  # long words
        return rng.choice(["a", "ab", "x", "\u00e9", "ー", "0"]) * rng.randint(50, 600)
    return "".join(chr(rng.randint(0x21, 0x7E)) for _ in range(rng.randint(1, 40)))


def generate_cases():
    """Returns a list of byte strings; about one in six is not valid UTF-8."""
    rng = random.Random(SEED)
    cases = [b"", b" ", b"\n", "▁".encode(), " ".join(SPECIALS).encode(), "".join(SPECIALS).encode()]
    cases += [s.encode() for s in SPECIALS + LOOKALIKES + WORDS + EMOJI + WHITESPACE]
    cases += INVALID
    while len(cases) < CASES:
        text = "".join(random_piece(rng) for _ in range(rng.randint(1, 12)))
        data = text.encode()
        if rng.random() < 0.17:
            parts = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                at = rng.randint(0, len(parts))
                noise = rng.choice(INVALID) if rng.random() < 0.7 else bytes(
                    rng.randint(0x80, 0xFF) for _ in range(rng.randint(1, 3)))
                parts[at:at] = noise
            data = bytes(parts)
        cases.append(data)
    return cases


def utf8_runs(data):
    """Splits bytes into valid UTF-8 strings and single invalid bytes (ints), in order."""
    decoded = data.decode("utf-8", errors="surrogateescape")
    runs, text = [], []
    for ch in decoded:
        if 0xDC80 <= ord(ch) <= 0xDCFF:
            if text:
                runs.append("".join(text))
                text = []
            runs.append(ord(ch) - 0xDC00)
        else:
            text.append(ch)
    if text:
        runs.append("".join(text))
    return runs


def reference_ids(tokenizer, data):
    ids = []
    for run in utf8_runs(data):
        if isinstance(run, int):
            ids.append(tokenizer.token_to_id(f"<0x{run:02X}>"))
        else:
            ids.extend(tokenizer.encode(run, add_special_tokens=False).ids)
    return ids


def request_line(data, parse_special):
    try:
        body = {"text": data.decode("utf-8")}
    except UnicodeDecodeError:
        body = {"text_base64": base64.b64encode(data).decode("ascii")}
    body["parse_special"] = parse_special
    return json.dumps(body)


def run_batch(lines, *flags):
    binary = os.environ.get("GEMMA4_BIN")
    if not binary:
        pytest.skip("GEMMA4_BIN is not set")
    done = subprocess.run([binary, "tokenize", "--tokenizer", str(TOKENIZER_JSON), "--jsonl",
                           *flags], input="\n".join(lines) + "\n", capture_output=True,
                          text=True, encoding="utf-8", check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    # split("\n"), not splitlines(): decoded text may hold U+2028 and friends.
    results = [json.loads(line) for line in done.stdout.split("\n")[:-1]]
    assert len(results) == len(lines)
    return results


@pytest.fixture(scope="module")
def hf():
    plain = Tokenizer.from_file(str(TOKENIZER_JSON))
    no_special = Tokenizer.from_file(str(TOKENIZER_JSON))
    no_special.encode_special_tokens = True
    return plain, no_special


def test_no_merge_involves_a_byte_token():
    model = json.loads(TOKENIZER_JSON.read_text(encoding="utf-8"))["model"]
    byte_tokens = {f"<0x{b:02X}>" for b in range(256)}
    assert not any(a in byte_tokens or b in byte_tokens for a, b in model["merges"])


def describe(data):
    return repr(data if len(data) < 200 else data[:200] + b"...")


@pytest.mark.parametrize("parse_special", [True, False])
def test_encode_decode_match_hf(hf, parse_special):
    reference = hf[0] if parse_special else hf[1]
    cases = generate_cases()
    assert len(cases) >= 10_000
    ours = run_batch([request_line(data, parse_special) for data in cases])

    expected = [reference_ids(reference, data) for data in cases]
    encode_mismatches = [(describe(d), e, o["ids"]) for d, e, o in zip(cases, expected, ours)
                         if o.get("ids") != e]
    assert not encode_mismatches, (f"{len(encode_mismatches)} of {len(cases)} differ; first: "
                                   f"{encode_mismatches[:3]}")

    decoded = run_batch([json.dumps({"ids": ids}) for ids in expected], "--decode")
    decode_mismatches = []
    for data, ids, result in zip(cases, expected, decoded):
        hf_text = reference.decode(ids, skip_special_tokens=False)
        if result.get("text") != hf_text:
            decode_mismatches.append((describe(data), ids, hf_text, result.get("text")))
    assert not decode_mismatches, (f"{len(decode_mismatches)} decodes differ; first: "
                                   f"{decode_mismatches[:3]}")

    for data, result in zip(cases, decoded):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if "\u2581" not in text:
            assert result["text"] == text, describe(data)


def test_skip_special_matches_hf(hf):
    ids = hf[0].encode("<bos><|turn>user\nHi <0x41> \u2581x<turn|>\n<|channel>",
                       add_special_tokens=False).ids
    ids += [478, 398, 1, 366, 366, 236743]  # a byte run across a special token
    for skip in (False, True):
        [result] = run_batch([json.dumps({"ids": ids, "skip_special": skip})], "--decode")
        assert result["text"] == hf[0].decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("stdin,flags", [
    ("not json", []),
    ('["text"]', []),
    ('{"text": 5}', []),
    ('{"txt": "a"}', []),
    ('{"text": "a", "text_base64": "YQ=="}', []),
    ('{"text_base64": "@@@"}', []),
    ('{"text": "a", "parse_special": "yes"}', []),
    ('{"ids": [1, -1]}', ["--decode"]),
    ('{"ids": [262144]}', ["--decode"]),
    ('{"ids": "1 2"}', ["--decode"]),
])
def test_bad_input_is_a_clear_error(stdin, flags):
    binary = os.environ.get("GEMMA4_BIN")
    if not binary:
        pytest.skip("GEMMA4_BIN is not set")
    done = subprocess.run([binary, "tokenize", "--tokenizer", str(TOKENIZER_JSON), *flags],
                          input=stdin, capture_output=True, text=True, check=False)
    assert done.returncode != 0
    assert done.stderr.startswith("gemma4 tokenize: ")
    assert done.stdout == ""


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    binary = os.environ.get("GEMMA4_BIN")
    if not binary:
        pytest.skip("GEMMA4_BIN is not set")
    done = subprocess.run([binary, "tokenize", "--tokenizer", str(tmp_path / "none.json")],
                          input='{"text": "a"}', capture_output=True, text=True, check=False)
    assert done.returncode != 0
    assert "none.json" in done.stderr
