"""tools/reference/device_check.py's twin with its decoder layers streamed (--stream-layers, how the
31B fits one H200 in float32) against the resident twin it replaces: the same logits bit for bit
and the same router picks, on tiny synthetic W4A16 / NVFP4 checkpoints, with at most one decoder
layer on the device at any time; and the whole check on the CPU passing with streamed layers.
Needs torch + transformers with Gemma 4 (the reference environment); skipped without them."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.gemma4")

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("GEMMA4_BIN", str(ROOT / "build" / "gemma4"))
sys.path.insert(0, str(ROOT / "tools" / "reference"))

import device_check  # noqa: E402
import router_trace  # noqa: E402
from golden import fixed_prompt  # noqa: E402

CHECKPOINTS = [("tiny", "w4a16"), ("tiny-moe", "w4a16"), ("tiny-moe", "nvfp4")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for config, packing in CHECKPOINTS:
        out = tmp_path_factory.mktemp(f"{config}-{packing}")
        subprocess.run([BIN, "synth", "--config", config, "--format", packing, "--seed", "1",
                        "-o", str(out)], check=True, capture_output=True, timeout=300)
        made[config, packing] = out
    return made


def twin_logits(checkpoint, stream_layers):
    model, config = device_check.build_model(str(checkpoint), "cpu", torch.float32, stream_layers)
    ids = fixed_prompt(config.sliding_window + 20)
    logits, forcing = router_trace.reference_logits(model, ids, "cpu")
    return model, logits, forcing.trace


@pytest.mark.parametrize("config,packing", CHECKPOINTS)
def test_streamed_twin_gives_the_resident_logits(checkpoints, config, packing):
    _, resident, resident_trace = twin_logits(checkpoints[config, packing], False)
    streamed_model, streamed, streamed_trace = twin_logits(checkpoints[config, packing], True)
    assert np.array_equal(streamed, resident)
    if resident_trace is not None:
        assert np.array_equal(streamed_trace.ids, resident_trace.ids)
        assert np.array_equal(streamed_trace.logits, resident_trace.logits)
    # After the forward no decoder layer holds weights; what stays resident is on the device.
    on_meta = {name: t.is_meta for name, t in streamed_model.state_dict().items()}
    assert all(meta for name, meta in on_meta.items() if name.startswith("model.layers."))
    assert not any(meta for name, meta in on_meta.items() if not name.startswith("model.layers."))


def test_streamed_twin_holds_one_decoder_layer_at_a_time(checkpoints):
    model, config = device_check.build_model(str(checkpoints["tiny-moe", "w4a16"]), "cpu",
                                             torch.float32, True)
    layers = model.model.layers
    on_device = []

    def count(layer, args):  # registered after the streamer's loader: runs once it has loaded
        on_device.append(sum(not next(m.parameters()).is_meta for m in layers))

    for layer in layers:
        layer.register_forward_pre_hook(count)
    router_trace.reference_logits(model, fixed_prompt(config.sliding_window + 20), "cpu")
    assert on_device == [1] * len(layers)


def test_device_check_passes_with_streamed_layers(checkpoints, tmp_path):
    """The whole check on the CPU engine (MoE: with the forced transformers runs)."""
    checkpoint = checkpoints["tiny-moe", "w4a16"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "reference" / "device_check.py"), "--checkpoint",
         str(checkpoint), "--gemma4", BIN, "--device", "cpu", "--torch-device", "cpu",
         "--dtype", "float32", "--stream-layers", "always", "--greedy", "8", "--out",
         str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / f"{checkpoint.name}-device-check.json").read_text())
    assert summary["pass"] and summary["transformers_layers_streamed"]
    assert summary["max_abs_dlogit"] < 1e-4
