"""The expert function written down (docs/PROTOCOL.md 11.2): its message, how a worker reads it
from a checkpoint, what the hub keeps of a stranger's, and the backbone using only the sessions
that compute its model's function."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch
from test_handshake import HUB, make_hub, make_worker

from backbone.experts._placement import Placement
from kvasir_rpc import ExpertFunction, session_pb2
from kvasir_rpc._function import CLAMPED_GLU, CLAMPED_SWIGLU
from kvasir_rpc._gen.kvasir.v1 import function_pb2

GPT_OSS = ExpertFunction(gate=CLAMPED_SWIGLU, activation="", alpha=1.702, limit=7.0, interleaved=True,
                         transposed=True, bias=True)


@pytest.mark.parametrize("fn", [ExpertFunction(), ExpertFunction(activation="gelu"), GPT_OSS,
                                ExpertFunction(transposed=True),
                                ExpertFunction(gate=CLAMPED_GLU, activation="silu", limit=10.0)],
                         ids=lambda f: f.describe())
def test_a_function_survives_its_message(fn):
    msg = function_pb2.ExpertFunction.FromString(fn.to_proto().SerializeToString())
    assert ExpertFunction.from_proto(msg, default_activation="relu") == fn


def test_an_unset_function_is_the_plain_one_with_the_checkpoints_activation():
    assert ExpertFunction.from_proto(function_pb2.ExpertFunction(), default_activation="gelu") == \
        ExpertFunction(activation="gelu")
    assert ExpertFunction().plain and not GPT_OSS.plain and not ExpertFunction(bias=True).plain


@pytest.mark.parametrize("msg,needle", [
    (function_pb2.ExpertFunction(gate=7), "not one this project computes"),
    (function_pb2.ExpertFunction(gate=function_pb2.EXPERT_GATE_CLAMPED_SWIGLU, alpha=1.0, limit=0.0), "positive limit"),
    (function_pb2.ExpertFunction(gate=function_pb2.EXPERT_GATE_CLAMPED_SWIGLU, alpha=float("nan"), limit=7.0),
     "finite alpha"),
])
def test_a_function_that_is_none_is_refused_with_a_reason(msg, needle):
    with pytest.raises(ValueError, match=needle):
        ExpertFunction.from_proto(msg, default_activation="silu")


def test_the_config_says_the_gate_and_the_tensors_say_the_layout():
    assert ExpertFunction.from_config({"hidden_act": "gelu"}, transposed=False, bias=False) == \
        ExpertFunction(activation="gelu")
    assert ExpertFunction.from_config({"hidden_act": "silu", "swiglu_limit": 7.0, "swiglu_alpha": 1.702},
                                      transposed=True, bias=True) == GPT_OSS
    # A limit without an alpha: the clamped GLU (DeepSeek-V4, Hunyuan V4); the clamped SwiGLU
    # stored [out, in] is concatenated (MiniMax-M3), transposed it is interleaved (gpt-oss).
    assert ExpertFunction.from_config({"swiglu_limit": 10.0, "hidden_act": "silu"}, transposed=False, bias=False) == \
        ExpertFunction(gate=CLAMPED_GLU, activation="silu", limit=10.0)
    assert ExpertFunction.from_config({"swiglu_limit": 7.0, "swiglu_alpha": 1.702}, transposed=False,
                                      bias=False) == dataclasses.replace(GPT_OSS, interleaved=False, transposed=False,
                                                                         bias=False)


def test_the_kernel_refuses_a_biased_function_without_biases():
    with pytest.raises(ValueError, match="has biases"):
        from kvasir_rpc import expert_forward

        expert_forward(torch.zeros(1, 4), torch.zeros(4, 4), torch.zeros(2, 4), GPT_OSS, torch.ones(1))


def _checkpoint(folder, *, transposed: bool, down_shape=None, bias: bool = False, limit: float | None = None):  # type: ignore[no-untyped-def]
    """A one-layer fused checkpoint (H 8, I 2, 2 experts) written with safetensors."""
    from safetensors.torch import save_file

    folder.mkdir()
    cfg = {"model_type": "x", "num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 2,
           "num_local_experts": 2, "hidden_act": "silu", "dtype": "float32"}
    if limit is not None:
        cfg["swiglu_limit"], cfg["swiglu_alpha"] = limit, 1.702
    (folder / "config.json").write_text(json.dumps(cfg))
    gu = torch.randn(2, 8, 4) if transposed else torch.randn(2, 4, 8)
    down = torch.randn(*(down_shape or ((2, 2, 8) if transposed else (2, 8, 2))))
    tensors = {"model.layers.0.mlp.experts.gate_up_proj": gu, "model.layers.0.mlp.experts.down_proj": down}
    if bias:
        tensors["model.layers.0.mlp.experts.gate_up_proj_bias"] = torch.randn(2, 4)
        tensors["model.layers.0.mlp.experts.down_proj_bias"] = torch.randn(2, 8)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_a_worker_reads_the_function_from_the_checkpoint(tmp_path):
    from kvasir_rpc import CheckpointError, ExpertIndex, expert_digest

    plain = ExpertIndex(_checkpoint(tmp_path / "plain", transposed=False))
    assert plain.function == ExpertFunction() and plain.biases(0, 1) is None
    oss = ExpertIndex(_checkpoint(tmp_path / "oss", transposed=True, bias=True, limit=7.0))
    assert oss.function == GPT_OSS
    gate_up, down = oss.load(0, 1)
    assert gate_up.shape == (8, 4) and down.shape == (2, 8)  # as stored
    b_gu, b_d = oss.biases(0, 1)  # type: ignore[misc]
    assert b_gu.shape == (4,) and b_d.shape == (8,)
    # The digest covers the biases: the same weights without them digest otherwise.
    assert oss.expert_digest(0, 1) == expert_digest(gate_up, down, b_gu, b_d) != expert_digest(gate_up, down)
    with pytest.raises(CheckpointError, match="fit neither"):
        ExpertIndex(_checkpoint(tmp_path / "odd", transposed=False, down_shape=(2, 8, 3)))


def test_the_hub_keeps_a_strangers_function_bounded():
    hub = make_hub()
    fn = GPT_OSS.to_proto(tuple(range(10_000)))
    fn.activation = "x" * 100_000  # a stranger's
    worker = make_worker(expected_hub_key=HUB.address, expert_function=fn)
    info = hub.receive_hello(worker.receive_challenge(hub.challenge()))
    kept = function_pb2.ExpertFunction.FromString(info.expert_function)
    assert len(kept.activation) == 64 and not kept.layers and kept.limit == 7.0
    # An old worker's hello has none: b"", listed as unset.
    hub2 = make_hub()
    info2 = hub2.receive_hello(make_worker(expected_hub_key=HUB.address).receive_challenge(hub2.challenge()))
    assert info2.expert_function == b""


def _session(fn: ExpertFunction | None, layers=(0, 1)) -> session_pb2.Session:  # type: ignore[no-untyped-def]
    s = session_pb2.Session(session_id="s", slices=[session_pb2.ExpertSlice(layer=layer, experts=[0]) for layer in layers])
    if fn is not None:
        s.expert_function.CopyFrom(fn.to_proto())
    return s


def test_the_backbone_routes_only_to_sessions_that_compute_its_function():
    def why(model_fn: ExpertFunction, session: session_pb2.Session) -> str:
        placement = types.SimpleNamespace(_weights=types.SimpleNamespace(functions={0: model_fn, 1: model_fn}))
        return Placement._other_function(placement, session)  # type: ignore[arg-type]

    assert why(GPT_OSS, _session(GPT_OSS)) == ""
    assert "clamped SwiGLU" in why(GPT_OSS, _session(ExpertFunction()))
    assert "announces no expert function" in why(GPT_OSS, _session(None))  # an old worker: the plain function
    assert why(ExpertFunction(), _session(None)) == ""
    assert why(ExpertFunction(), _session(ExpertFunction())) == ""
    assert "gelu" in why(ExpertFunction(), _session(ExpertFunction(activation="gelu")))
    other_limit = dataclasses.replace(GPT_OSS, limit=8.0)
    assert "limit 8" in why(GPT_OSS, _session(other_limit))
    bad = _session(None)
    bad.expert_function.gate = 9
    assert "not one this project computes" in why(GPT_OSS, bad)
