"""The worker reads only its slices: resident memory follows the slice, not the model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

# Integration: loads a checkpoint in a subprocess.
pytestmark = pytest.mark.integration

HIDDEN, INTER, EXPERTS, LAYERS = 256, 512, 64, 4
EXPERT_BYTES = 3 * HIDDEN * INTER * 4  # gate, up, down in float32


def _big_checkpoint(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_hidden_layers": LAYERS, "num_experts": EXPERTS, "hidden_size": HIDDEN,
        "moe_intermediate_size": INTER, "hidden_act": "silu", "dtype": "float32",
    }))
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            tensors[f"{p}.gate_proj.weight"] = torch.randn(INTER, HIDDEN, generator=g)
            tensors[f"{p}.up_proj.weight"] = torch.randn(INTER, HIDDEN, generator=g)
            tensors[f"{p}.down_proj.weight"] = torch.randn(HIDDEN, INTER, generator=g)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


PROBE = """
import json, sys, psutil, torch
from kvasir_rpc import get_activation
from worker._load import load_experts
get_activation("silu")  # import transformers' activations before measuring
proc = psutil.Process()
before = proc.memory_info().rss
experts = load_experts(sys.argv[1], sys.argv[2], "cpu")
after = proc.memory_info().rss
print(json.dumps({"delta": after - before, "n": len(experts.weights)}))
import gc; gc.freeze()  # exit without the final collection's walk over torch's objects (seconds)
"""


def _rss_delta(model, spec):
    out = subprocess.run([sys.executable, "-c", PROBE, str(model), spec], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_resident_memory_follows_the_slice(tmp_path):
    model = tmp_path / "big"
    _big_checkpoint(model)
    total = EXPERT_BYTES * EXPERTS * LAYERS  # 384 MiB of experts on disk
    one = _rss_delta(model, "0:0")
    layer = _rss_delta(model, "0:*")
    assert one["n"] == 1 and layer["n"] == EXPERTS
    assert one["delta"] < 32 << 20, one  # one 1.5 MiB expert, not the 384 MiB model
    assert layer["delta"] < EXPERT_BYTES * EXPERTS * 1.6 + (32 << 20), layer
    assert layer["delta"] < total / 2
