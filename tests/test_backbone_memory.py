"""When experts live on workers, the backbone never holds their weights, not even while it
loads: its peak memory is the dense part plus the experts it computes."""

from __future__ import annotations

import pytest
import torch

from backbone.engine._decode import decode, load_model, prompts_for_batch
from backbone.experts._dispatch import Dispatcher
from kvasir.swarm import LocalSwarm
from kvasir.tiny import make_tiny_checkpoint
from kvasir_rpc import ExpertIndex

# Integration: starts a local swarm of real processes and loads real transformers models.
pytestmark = pytest.mark.integration

# Experts are most of this model: 64 experts x 4 layers x 1.5 MiB = 384 MiB; the dense part
# (attention, embeddings, router) is under 2 MiB.
BIG_EXPERTS = {"hidden_size": 256, "num_experts": 64, "moe_intermediate_size": 512}
EXPERT_BYTES = 64 * 4 * 3 * 256 * 512 * 4


def test_backbone_memory_follows_dense_part_plus_local_experts(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "model", arch="qwen3_moe", seed=0, overrides=BIG_EXPERTS)
    args = ["--model", str(model), "--prompt", "lean", "--max-new-tokens", "4", "--batch", "2"]
    with LocalSwarm(tmp_path / "swarm") as sw:
        sw.start_hub()
        sw.start_worker("worker1", model, "all")
        sw.wait_sessions(1, watch=["worker1"])
        full = sw.run_backbone([*args, "--expert-weights", "all"])
        lean = sw.run_backbone(args)
        # No workers at all: every expert is read from the checkpoint when first needed.
        alone = sw.run_backbone([*args, "--expert-weights", "on-demand"], hub=False)
    print({name: {"rss": r["rss_bytes"], "peak_rss": r["peak_rss_bytes"], "expert_bytes": r["expert_bytes_held"]}
           for name, r in (("full", full), ("lean", lean), ("alone", alone))})
    assert full["expert_weights"] == "all" and full["expert_bytes_held"] == EXPERT_BYTES
    assert lean["expert_weights"] == "on-demand" and lean["expert_bytes_held"] == 0
    assert lean["remote_rows"] == full["remote_rows"] > 0 and lean["fallback_calls"] == 0
    assert lean["texts"] == full["texts"] == alone["texts"]
    assert 0 < alone["expert_bytes_held"] <= EXPERT_BYTES and alone["remote_rows"] == 0
    # Resident memory drops by (nearly) the experts' size, at its peak (loading included) as
    # well as at the end: the experts are never read, not even transiently.
    assert full["rss_bytes"] - lean["rss_bytes"] > 0.75 * EXPERT_BYTES, (full["rss_bytes"], lean["rss_bytes"])
    assert full["peak_rss_bytes"] - lean["peak_rss_bytes"] > 0.75 * EXPERT_BYTES, (
        full["peak_rss_bytes"], lean["peak_rss_bytes"])
    # Computing experts here costs what they weigh, no more.
    assert alone["peak_rss_bytes"] < lean["peak_rss_bytes"] + alone["expert_bytes_held"] + 0.25 * EXPERT_BYTES


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe", "mixtral"])
def test_model_loaded_without_experts_is_the_same_model(tiny_models, arch):  # type: ignore[no-untyped-def]
    """The lean loader gives transformers' own model, tensor for tensor and bit for bit,
    with the routed experts left on meta; its decode (experts read on demand) is the full
    model's, logits bitwise."""
    path = tiny_models(arch)
    full, tokenizer = load_model(path)
    lean, _ = load_model(path, experts="on-demand")
    full_state, lean_state = full.state_dict(), lean.state_dict()
    assert full_state.keys() == lean_state.keys()
    on_meta = sorted(k for k, t in lean_state.items() if t.is_meta)
    assert on_meta and all(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in on_meta), on_meta
    for k, t in lean_state.items():
        if not t.is_meta:
            assert t.dtype == full_state[k].dtype and torch.equal(t, full_state[k]), k
    full_buffers = dict(full.named_buffers())
    for k, b in lean.named_buffers():
        assert torch.equal(b, full_buffers[k]), k
    assert lean.generation_config.to_dict() == full.generation_config.to_dict()

    prompts = prompts_for_batch("lean", 2)
    d_full = Dispatcher(full, None)
    d_lean = Dispatcher(lean, None, expert_source=ExpertIndex(path))
    try:
        a, b = decode(full, tokenizer, prompts, 3), decode(lean, tokenizer, prompts, 3)
    finally:
        d_full.close()
        d_lean.close()
    assert torch.equal(a.logits, b.logits) and torch.equal(a.new_tokens, b.new_tokens)
    assert 0 < d_lean.statistics().expert_bytes_held <= d_full.statistics().expert_bytes_held


def test_on_demand_weights_refuse_a_model_that_holds_its_experts(tiny_models):  # type: ignore[no-untyped-def]
    path = tiny_models("qwen3_moe")
    model, _ = load_model(path)
    with pytest.raises(ValueError, match="loaded without its experts"):
        Dispatcher(model, None, expert_source=ExpertIndex(path))
