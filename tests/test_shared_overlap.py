"""Qwen3.5's shared expert is computed inside the experts call, after the remote calls
leave, and the output stays bitwise what transformers computes; a block that used the
shared output before the experts call would raise, not decode wrongly.

In-process: the Dispatcher runs in remote mode against a session list with no workers
(every routed expert is computed here), which exercises the deferral without a swarm;
tests/test_swarm.py checks the same through real workers."""

from __future__ import annotations

import pytest
import torch

from backbone.engine._decode import decode, decode_grouped, load_model, prompts_for_batch
from backbone.experts._dispatch import Dispatcher

# Integration: loads a real transformers model.
pytestmark = pytest.mark.integration


class _NoSessions:
    """What the Dispatcher reads from a SessionWatcher: a version and no live sessions."""

    version = 1

    @staticmethod
    def sessions() -> dict[str, object]:
        return {}


@pytest.fixture(scope="module")
def qwen35(tiny_models):  # type: ignore[no-untyped-def]
    model, tokenizer = load_model(tiny_models("qwen3_5_moe"))
    return model, tokenizer


def test_deferred_shared_expert_is_bitwise_unchanged(qwen35) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = qwen35
    prompts = prompts_for_batch("shared", 4)
    reference = decode(model, tokenizer, prompts, 5, implementation="eager")
    d = Dispatcher(model, _NoSessions())  # type: ignore[arg-type]
    try:
        run = decode(model, tokenizer, prompts, 5)
        assert torch.equal(run.logits, reference.logits) and torch.equal(run.new_tokens, reference.new_tokens)
        layers = len(d.weights.modules)
        assert d.statistics().shared_overlapped == layers * 5  # every layer, every forward (prefill + 4 steps)
        # Groups decode in threads at once: each thread keeps its own pending shared outputs.
        grouped_ref = decode_grouped(model, tokenizer, prompts, 5, 2, implementation="eager")
        grouped = decode_grouped(model, tokenizer, prompts, 5, 2)
        assert torch.equal(grouped.logits, grouped_ref.logits)
        # Local mode (remote off): the shared expert runs where transformers calls it.
        d.remote = False
        before = d.statistics().shared_overlapped
        local = decode(model, tokenizer, prompts, 5)
        assert torch.equal(local.logits, reference.logits) and d.statistics().shared_overlapped == before
    finally:
        d.close()


def test_shared_output_used_before_it_is_computed_raises(qwen35) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = qwen35
    d = Dispatcher(model, _NoSessions())  # type: ignore[arg-type]
    d.shared.run = lambda layer: None  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="shared expert's output was used before"):
            decode(model, tokenizer, prompts_for_batch("shared", 2), 2)
    finally:
        d.close()
    # A fresh Dispatcher replaces the previous one's wrapping and decodes normally again.
    d2 = Dispatcher(model, _NoSessions())  # type: ignore[arg-type]
    try:
        run = decode(model, tokenizer, prompts_for_batch("shared", 2), 2)
        ref = decode(model, tokenizer, prompts_for_batch("shared", 2), 2, implementation="eager")
        assert torch.equal(run.logits, ref.logits) and d2.statistics().shared_overlapped > 0
    finally:
        d2.close()
