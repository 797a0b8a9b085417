"""When experts live on workers, the backbone does not hold their weights."""

from __future__ import annotations

from kvasir_rpc import make_tiny_checkpoint
from kvasir_rpc._swarm import LocalSwarm

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
    # Resident memory drops by (nearly) the experts' size.
    assert full["rss_bytes"] - lean["rss_bytes"] > 0.75 * EXPERT_BYTES, (full["rss_bytes"], lean["rss_bytes"])
