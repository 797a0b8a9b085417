"""Quantized releases (issue 29) through a real swarm: made in the release layout from a
transformers bfloat16 checkpoint (block FP8: ``quant_method: "fp8"``, float8_e4m3fn weights with
a float32 ``weight_scale_inv`` per block; MXFP4: gpt-oss's ``*_blocks`` and ``*_scales``;
compressed-tensors as llm-compressor writes it: FP8_DYNAMIC and W4A16), served
with every expert remote by workers that keep their experts quantized and dequantize per call: tokens and logits bitwise the local run's (transformers'
own dequantize-on-CPU model), on the backbone's two loading paths; a worker that drops the
scales is refused on its first call and earns nothing."""

from __future__ import annotations

import pathlib

import pytest
from helpers import swarm_with_dishonest

from kvasir.families import make_family_checkpoint
from kvasir.swarm import LocalSwarm

pytestmark = pytest.mark.integration

TESTS = pathlib.Path(__file__).resolve().parent
# Blocks of 16: the tiny weights (64 x 32) get several per matrix, as a release's 7168 x 2048 do at 128.
BLOCK = 16


@pytest.mark.parametrize("model_type,quant", [("qwen3_moe", "fp8"), ("deepseek_v3", "fp8"), ("glm4_moe", "fp8"),
                                              ("gpt_oss", "mxfp4"), ("qwen3_moe", "ct-fp8"),
                                              ("deepseek_v3", "ct-int4")])
def test_a_quantized_release_is_served_exact(model_type, quant, tmp_path):
    model = make_family_checkpoint(tmp_path / "model", model_type, dtype="bfloat16", shard="100KB", quant=quant,
                                   block=BLOCK)
    with LocalSwarm(tmp_path / "swarm") as sw:
        sw.start_ledger()
        sw.start_hub(receipt_interval=0.5, extra=["--model", str(model)])
        sw.start_worker("w1", model, "*:0-3")
        sw.start_worker("w2", model, "*:4-7")
        sw.wait_sessions(2, watch=["w1", "w2"])
        args = ["--model", str(model), "--prompt", f"{quant} experts of {model_type}", "--batch", "2",
                "--max-new-tokens", "8", "--wait-sessions", "2", "--json"]
        result = sw.run_backbone([*args, "--compare-local", "--require-bitwise"])
        assert result["backbone_exit_code"] == 0, result
        assert result["verdict"] == "bitwise equal" and result["wire_dtype"] == "bfloat16"
        assert result["reference_tokens_identical"] is True  # transformers' own dequantized model
        assert result["local_rows"] == 0 and result["fallback_calls"] == 0 and result["remote_rows"] > 0
        assert result["sessions_quarantined"] == [] and result["row_checked_rows"] == result["remote_rows"]
        # The backbone without the experts (the dense part dequantized as transformers does): the same text.
        on_demand = sw.run_backbone(args)
        assert on_demand["expert_weights"] == "on-demand" and on_demand["texts"] == result["texts"]
        sessions = sw.list_sessions()
        credited = sw.wait_credited(sessions)
        for s in sessions:
            assert credited[s.session_id] == s.work_bytes > 0


LIAR = str(TESTS / "liar_worker.py")


def _with(sw: LocalSwarm, model: pathlib.Path, lie: str) -> str:
    """Ledger, hub, an honest worker and tests/liar_worker.py LIE, joined; the liar's session."""
    liar, _ = swarm_with_dishonest(sw, model, lie, (LIAR, lie, "--"))
    return str(liar.session_id)


def _decode(sw: LocalSwarm, model: pathlib.Path, *extra: str) -> dict:  # type: ignore[type-arg]
    return sw.run_backbone(["--model", str(model), "--prompt", "a stranger's experts", "--batch", "2",
                            "--max-new-tokens", "8", "--compare-local", "--wait-sessions", "2", "--json", *extra])


def test_a_worker_that_drops_the_fp8_scales_is_refused_and_earns_nothing(tmp_path):
    model = make_family_checkpoint(tmp_path / "model", "qwen3_moe", dtype="bfloat16", quant="fp8", block=BLOCK)
    with LocalSwarm(tmp_path / "swarm") as sw:
        liar = _with(sw, model, "noscale")
        result = _decode(sw, model, "--require-bitwise")
        assert result["backbone_exit_code"] == 0 and result["verdict"] == "bitwise equal", result
        assert result["sessions_quarantined"] == [liar] and result["row_check_refusals"] >= 1
        sessions = [s for s in sw.list_sessions() if s.session_id != liar]
        credited = sw.wait_credited(sessions)
        assert all(credited[s.session_id] == s.work_bytes > 0 for s in sessions)


def test_a_worker_that_drops_the_int4_scales_is_refused_and_earns_nothing(tmp_path):
    # compressed-tensors W4A16: the integers taken as the weights, without their group scales.
    model = make_family_checkpoint(tmp_path / "model", "qwen3_moe", dtype="bfloat16", quant="ct-int4")
    with LocalSwarm(tmp_path / "swarm") as sw:
        liar = _with(sw, model, "noscale")
        result = _decode(sw, model, "--require-bitwise")
        assert result["backbone_exit_code"] == 0 and result["verdict"] == "bitwise equal", result
        assert result["sessions_quarantined"] == [liar] and result["row_check_refusals"] >= 1
        sessions = [s for s in sw.list_sessions() if s.session_id != liar]
        credited = sw.wait_credited(sessions)
        assert all(credited[s.session_id] == s.work_bytes > 0 for s in sessions)


def test_an_honest_worker_summing_in_another_order_on_fp8_is_never_caught(tmp_path):
    model = make_family_checkpoint(tmp_path / "model", "qwen3_moe", dtype="bfloat16", quant="fp8", block=BLOCK)
    with LocalSwarm(tmp_path / "swarm") as sw:
        _with(sw, model, "reorder")
        result = _decode(sw, model, "--audit-rate", "1")
        assert result["backbone_exit_code"] == 0, result
        assert result["sessions_quarantined"] == [] and result["fallback_calls"] == 0
        assert result["audited_rows"] == result["remote_rows"] > 0
        assert result["verdict"] in ("bitwise equal", "within the audit bound, tokens identical")


def test_a_worker_that_rounds_bfloat16_experts_to_fp8_is_refused(tmp_path):
    # A coarser format than the checkpoint's (half the memory, 1/16 of each value off): the row
    # checks refuse its first answer; the output is the local run's, bit for bit.
    model = make_family_checkpoint(tmp_path / "model", "qwen3_moe", dtype="bfloat16")
    with LocalSwarm(tmp_path / "swarm") as sw:
        liar = _with(sw, model, "coarse")
        result = _decode(sw, model, "--require-bitwise")
        assert result["backbone_exit_code"] == 0 and result["verdict"] == "bitwise equal", result
        assert result["sessions_quarantined"] == [liar] and result["row_check_refusals"] >= 1
