"""`gemma4 run --router-trace` on a synthetic tiny-moe checkpoint: one row per (pass, layer,
token) of [layer, position, logits, ids, weights], the ids being the top-k of the row's logits
(ties: lower id first) and the weights the renormalised softmax of those logits times the
checkpoint's per_expert_scale (read here from the safetensors file itself); a dense model is a
clear error. tools/reference/router_trace.py reads these files."""

import json
import os
import pathlib
import struct
import subprocess

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("GEMMA4_BIN", str(ROOT / "build" / "gemma4"))


def gemma4(*args, check=True):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=600,
                          check=check)


def safetensors_f32(directory, suffix):
    """{name: float32 array} of every tensor whose name ends with `suffix` (fp32 or bf16)."""
    found = {}
    for path in pathlib.Path(directory).glob("*.safetensors"):
        data = path.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + length])
        for name, info in header.items():
            if name == "__metadata__" or not name.endswith(suffix):
                continue
            begin, end = info["data_offsets"]
            raw = data[8 + length + begin:8 + length + end]
            if info["dtype"] == "F32":
                found[name] = np.frombuffer(raw, np.float32)
            elif info["dtype"] == "BF16":
                found[name] = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return found


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_moe")
    gemma4("synth", "--config", "tiny-moe", "--format", "bf16", "--seed", 4, "-o", out)
    return out


def test_trace_rows_are_the_router_of_their_logits(tiny_moe, tmp_path):
    config = json.loads((tiny_moe / "config.json").read_text())
    config = config.get("text_config", config)
    experts, top_k, layers = config["num_experts"], config["top_k_experts"], config["num_hidden_layers"]
    scales = safetensors_f32(tiny_moe, "router.per_expert_scale")
    assert len(scales) == layers
    trace = tmp_path / "router.npy"
    prompt = [2, 1000, 2000, 3000, 4000]
    gemma4("run", "-m", tiny_moe, "--prompt-ids", ",".join(map(str, prompt)), "-n", 3,
           "--temperature", 0, "--ignore-eos", "--router-trace", trace)
    rows = np.load(trace)
    # The prompt in one pass, then two decode steps (the last token is never fed back).
    assert rows.shape == ((len(prompt) + 2) * layers, 2 + experts + 2 * top_k)
    seen = {(int(r[0]), int(r[1])) for r in rows}
    assert seen == {(l, p) for l in range(layers) for p in range(len(prompt) + 2)}
    for row in rows:
        layer = int(row[0])
        logits = row[2:2 + experts].astype(np.float64)
        ids = row[2 + experts:2 + experts + top_k].astype(np.int64)
        weights = row[2 + experts + top_k:]
        expected = np.argsort(-logits, kind="stable")[:top_k]
        assert list(ids) == list(expected)
        (scale,) = [v for k, v in scales.items() if f"layers.{layer}." in k]
        probabilities = np.exp(logits[ids] - logits.max())
        np.testing.assert_allclose(weights, probabilities / probabilities.sum() * scale[ids],
                                   rtol=1e-5)


def test_dense_model_is_a_clear_error(tmp_path):
    dense = tmp_path / "tiny"
    gemma4("synth", "--config", "tiny", "--format", "bf16", "--seed", 1, "-o", dense)
    out = gemma4("run", "-m", dense, "--prompt-ids", "2,100", "-n", 1,
                 "--router-trace", tmp_path / "r.npy", check=False)
    assert out.returncode != 0
    assert "no experts" in out.stderr
