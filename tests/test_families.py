"""The Mixture-of-Experts families transformers ships, as a user gets them: tiny checkpoints
made by transformers' own ``save_pretrained`` (kvasir.families). One test walks every
model type of the installed transformers whose experts go through ``ExpertsInterface`` and
prints which this project serves exactly and which not, saying why; then the families issue
28 names, bfloat16 and sharded as releases are, through a real swarm: every expert remote,
logits bitwise the local run's, credits exact."""

from __future__ import annotations

import pathlib

import pytest

from kvasir.swarm import LocalSwarm

pytestmark = pytest.mark.integration

SERVED = "served exact"


def judge(model_type: str, folder: pathlib.Path, *, dtype: str = "float32") -> str:
    """Make the family's tiny checkpoint in ``folder`` and check each part of the path: the
    checkpoint as a worker reads it (every expert of every MoE layer found, its weights equal
    to the model's), the model as the backbone loads it, its experts' declared function, and
    one forward through the backbone's experts implementation against transformers' eager
    experts (same tokens; on one machine the remote path runs the same kernel as the local one)."""
    import torch

    from kvasir.families import make_family_checkpoint
    from kvasir_rpc import CheckpointError, ExpertIndex, check_checkpoint

    try:
        make_family_checkpoint(folder, model_type, dtype=dtype)
    except ValueError as exc:
        return f"not served: {exc}"
    try:
        check_checkpoint(folder)
        index = ExpertIndex(folder)
    except CheckpointError as exc:
        return f"not served: a worker cannot read its experts: {str(exc).replace(str(folder) + '/', '')}"
    from backbone.engine._decode import load_model
    from backbone.experts._dispatch import Dispatcher
    from backbone.experts._weights import experts_modules
    from kvasir_rpc import function_of_module

    try:
        model, _ = load_model(folder)
    except Exception as exc:  # transformers' own failure to load what it saved
        return f"not served: transformers cannot load the checkpoint it saved: {type(exc).__name__}: {str(exc)[:160]}"
    try:
        modules = experts_modules(model)
    except ValueError as exc:
        return f"not served: {exc}"
    for layer, module in modules.items():
        declared = function_of_module(module)
        if index.function != declared:
            return (f"not served: a worker reads the expert function {index.function.describe()} from the checkpoint; "
                    f"transformers declares {declared.describe()}")
        fused_gate_up, fused_down = module.gate_up_proj, module.down_proj
        assert isinstance(fused_gate_up, torch.Tensor) and isinstance(fused_down, torch.Tensor)
        for e in range(int(fused_gate_up.shape[0])):
            if not index.has(layer, e):
                return f"not served: layer {layer} expert {e} is not where a worker looks for it in the checkpoint"
        gate_up, down = index.load(layer, 0)
        if not (torch.equal(gate_up, fused_gate_up[0]) and torch.equal(down, fused_down[0])):
            return f"not served: layer {layer} expert 0 as a worker reads it differs from the model's"
        biases = index.biases(layer, 0)
        if declared.bias and not (biases is not None and torch.equal(biases[0], module.gate_up_proj_bias[0])
                                  and torch.equal(biases[1], module.down_proj_bias[0])):
            return f"not served: layer {layer} expert 0's biases as a worker reads them differ from the model's"
    Dispatcher(model, None)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    with torch.inference_mode():
        try:
            model.set_experts_implementation("kvasir")
            ours = model(input_ids=ids, use_cache=False).logits.float()
            model.set_experts_implementation("eager")
            eager = model(input_ids=ids, use_cache=False).logits.float()
        except Exception as exc:
            return f"not served: the forward pass failed: {type(exc).__name__}: {str(exc)[:160]}"
    if not torch.equal(ours.argmax(-1), eager.argmax(-1)):
        return f"not served: tokens differ from transformers' eager experts (max |diff| {float((ours - eager).abs().max()):.3g})"
    return SERVED


# Served exactly before this walk existed (issue 28's table), and the families it added.
SERVED_BEFORE = ["qwen3_moe", "qwen3_next", "mixtral", "olmoe", "qwen2_moe", "minimax_m2", "hunyuan_v1_moe", "phimoe",
                 "flex_olmo"]
NOW_SERVED = ["deepseek_v3", "deepseek_v2", "glm4_moe", "dots1", "ernie4_5_moe", "gpt_oss", "granitemoe", "deepseek_v4"]
# Served exact by the walk too (their functions written down: clamped GLU, clamped SwiGLU over
# concatenated weights, transposed weights; DeepSeek-V3.2's and GLM-5's dense first layers).
WALK_SERVED = ["aria_text", "granitemoeshared", "hy_v4", "minimax_m3_vl_text", "deepseek_v32", "glm_moe_dsa"]


def test_every_moe_family_transformers_ships_is_served_exact_or_says_why(tmp_path, capsys):
    from kvasir.families import moe_model_types

    verdicts = {mt: judge(mt, tmp_path / mt) for mt in moe_model_types()}
    with capsys.disabled():
        width = max(map(len, verdicts))
        print(f"\n{len(verdicts)} Mixture-of-Experts model types in this transformers; "
              f"{sum(v == SERVED for v in verdicts.values())} served exact:")
        for mt, verdict in verdicts.items():
            print(f"  {mt:<{width}}  {verdict}")
    for mt, verdict in verdicts.items():
        assert verdict == SERVED or verdict.startswith("not served: "), (mt, verdict)
    missing = [mt for mt in SERVED_BEFORE + NOW_SERVED + WALK_SERVED if verdicts.get(mt) != SERVED]
    assert not missing, {mt: verdicts.get(mt) for mt in missing}


@pytest.mark.parametrize("model_type", NOW_SERVED)
def test_a_family_as_released_is_served_exact_by_the_swarm(model_type, tmp_path):
    from kvasir.families import make_family_checkpoint

    model = make_family_checkpoint(tmp_path / "model", model_type, dtype="bfloat16", shard="100KB")
    assert len(list(model.glob("model-*.safetensors"))) > 1  # sharded, as releases are
    with LocalSwarm(tmp_path / "swarm") as sw:
        sw.start_ledger()
        sw.start_hub(receipt_interval=0.5, extra=["--model", str(model)])  # the hub checks slices against it
        sw.start_worker("w1", model, "*:0-3")
        sw.start_worker("w2", model, "*:4-7")
        sw.wait_sessions(2, watch=["w1", "w2"])
        result = sw.run_backbone(["--model", str(model), "--prompt", "the experts of " + model_type, "--batch", "2",
                                  "--max-new-tokens", "10", "--compare-local", "--wait-sessions", "2", "--json"])
        assert result["backbone_exit_code"] == 0, result
        assert result["bit_exact_wire"] is True and result["wire_dtype"] == "bfloat16"
        assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0
        assert result["reference_tokens_identical"] is True  # against transformers' eager experts
        assert result["local_rows"] == 0 and result["fallback_calls"] == 0 and result["remote_rows"] > 0
        assert result["sessions_quarantined"] == [] and result["row_checked_rows"] == result["remote_rows"]
        sessions = sw.list_sessions()
        credited = sw.wait_credited(sessions)
        for s in sessions:
            assert credited[s.session_id] == s.work_bytes > 0


def test_a_worker_announcing_another_function_gets_no_rows_and_the_output_stays_exact(tmp_path):
    # A stranger holding gpt-oss's weights (digest right) that announces the plain SwiGLU: the
    # backbone does not route to it; its experts are computed here, the tokens stay exact, and
    # it earns nothing.
    from helpers import swarm_with_dishonest

    from kvasir.families import make_family_checkpoint

    liar_worker = str(pathlib.Path(__file__).with_name("liar_worker.py"))
    model = make_family_checkpoint(tmp_path / "model", "gpt_oss", dtype="bfloat16", shard="100KB")
    with LocalSwarm(tmp_path / "swarm") as sw:
        plain, honest = swarm_with_dishonest(sw, model, "plain", (liar_worker, "honest", "--announce-plain", "--"))
        assert plain.expert_function.gate == 1 and not plain.expert_function.interleaved  # as the hub lists it
        result = sw.run_backbone(["--model", str(model), "--prompt", "another function", "--max-new-tokens", "6",
                                  "--compare-local", "--wait-sessions", "2", "--json"])
        assert result["backbone_exit_code"] == 0, result
        assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0
        assert result["remote_rows"] > 0 and result["local_rows"] > 0  # the plain worker's experts computed here
        work = {s.session_id: s.work_bytes for s in sw.list_sessions()}
        assert work[plain.session_id] == 0 and work[honest.session_id] > 0
