"""Assisted decoding (``--assist``): drafts verified in one forward pass of the big model.

In process (the tiny qwen3_moe, every expert local): prompt-lookup and draft-model decoding
give the tokens plain greedy decoding gives, with drafts accepted and fewer forward passes
than tokens. Through real processes (a hub and two workers): the remote assisted decode
equals the local assisted decode bitwise, logits included, and makes fewer remote calls per
token than a plain remote decode. Bad combinations end in one line, exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

PASSAGE = "The quick brown fox jumps over the lazy dog while the swarm computes experts far away."
# The prompt quotes a passage and asks for it again: prompt lookup has text to copy, and the
# tiny model's greedy output falls into loops that lookup catches too.
PROMPT = f"Passage: {PASSAGE}\nRepeat the passage exactly: {PASSAGE}"
TOKENS = 32


@pytest.fixture(scope="module")
def local_model(tiny_models):  # type: ignore[no-untyped-def]
    from backbone.engine._decode import load_model
    from backbone.experts._dispatch import Dispatcher

    torch.set_num_threads(1)
    model, tokenizer = load_model(tiny_models("qwen3_moe"))
    dispatcher = Dispatcher(model, None)  # no hub: every expert local, through the same kernel
    yield model, tokenizer
    dispatcher.close()


@pytest.fixture(scope="module")
def plain(local_model):  # type: ignore[no-untyped-def]
    from backbone.engine._decode import decode

    model, tokenizer = local_model
    return decode(model, tokenizer, [PROMPT], TOKENS)


def test_lookup_equals_plain_greedy(local_model, plain) -> None:  # type: ignore[no-untyped-def]
    from backbone.engine._assist import PromptLookup, decode_assisted

    model, tokenizer = local_model
    run, stats = decode_assisted(model, tokenizer, PROMPT, TOKENS, PromptLookup(3), k=4)
    assert torch.equal(run.new_tokens, plain.new_tokens)
    # A k+1-row forward pass may round differently from a one-row pass; the tokens may not.
    assert run.logits.shape == plain.logits.shape
    assert torch.allclose(run.logits, plain.logits, rtol=0, atol=1e-4)
    assert stats.tokens == TOKENS and stats.accepted > 0
    assert stats.steps + 1 < TOKENS  # fewer forward passes than tokens


def test_lookup_proposes_what_followed() -> None:
    from backbone.engine._assist import PromptLookup

    look = PromptLookup(3)
    assert look.propose([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]
    assert look.propose([1, 2, 3, 7, 8, 1, 2, 3, 4, 6, 2, 3], 3) == [4, 6, 2]  # the latest occurrence
    assert look.propose([5, 6, 7], 4) == []
    assert look.propose([5], 4) == []
    assert look.propose([5, 6, 5], 4) == []  # one-token tails only when asked for
    assert PromptLookup(1).propose([5, 6, 5], 4) == [6, 5]


@pytest.mark.parametrize("draft_kind", ["same", "other"])
def test_draft_model_equals_plain_greedy(local_model, plain, tiny_models, tmp_path, draft_kind) -> None:  # type: ignore[no-untyped-def]
    """A draft model that agrees with the big model (the same checkpoint, its own experts
    eager) has nearly every draft accepted; an unrelated one (another seed, one layer) has
    few; the tokens are greedy's either way."""
    from backbone.engine._assist import DraftModel, decode_assisted
    from backbone.engine._decode import load_model
    from kvasir.tiny import make_tiny_checkpoint

    model, tokenizer = local_model
    path = tiny_models("qwen3_moe") if draft_kind == "same" else make_tiny_checkpoint(
        tmp_path / "draft", seed=1, overrides={"num_hidden_layers": 1})
    draft, _ = load_model(path)
    run, stats = decode_assisted(model, tokenizer, PROMPT, TOKENS, DraftModel(draft), k=4, mode="draft")
    assert torch.equal(run.new_tokens, plain.new_tokens)
    if draft_kind == "same":
        assert stats.accepted >= stats.proposed // 2 and stats.steps < TOKENS // 2


def _remote_args(sw) -> list[str]:  # type: ignore[no-untyped-def]
    return ["--model", str(sw.model), "--prompt", PROMPT, "--max-new-tokens", str(TOKENS), "--wait-sessions", "2"]


@pytest.mark.integration
def test_remote_assisted_equals_local_assisted(two_worker_swarm) -> None:  # type: ignore[no-untyped-def]
    run = two_worker_swarm.run_backbone([*_remote_args(two_worker_swarm), "--assist", "lookup", "--compare-local"],
                                        timeout=120)
    assert run["backbone_exit_code"] == 0
    assert run["tokens_identical"] is True and run["max_abs_logit_diff"] == 0.0
    assert run["plain_greedy_tokens_identical"] is True
    assert run["fallback_calls"] == 0 and run["remote_calls"] > 0
    assert run["draft_tokens_accepted"] > 0 and run["forward_passes_per_token"] < 1


@pytest.mark.integration
def test_assisted_makes_fewer_remote_calls_per_token(two_worker_swarm) -> None:  # type: ignore[no-untyped-def]
    plain_run = two_worker_swarm.run_backbone(_remote_args(two_worker_swarm), timeout=120)
    run = two_worker_swarm.run_backbone([*_remote_args(two_worker_swarm), "--assist", "lookup"], timeout=120)
    assert run["texts"] == plain_run["texts"]
    plain_calls = plain_run["remote_calls"] / plain_run["n_tokens"]
    assert run["remote_calls_per_token"] < plain_calls, (run["remote_calls_per_token"], plain_calls)


def _backbone(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "backbone", "generate", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL,
                          env={**os.environ, "KVASIR_THREADS": "1"})


def _fails(out: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, last


@pytest.mark.integration
def test_bad_combinations_end_in_one_line(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvasir.tiny import make_tiny_checkpoint

    model = str(tiny_models("qwen3_moe"))
    base = ["--model", model, "--prompt", "x", "--max-new-tokens", "2"]
    _fails(_backbone(*base, "--assist", "lookup", "--batch", "2"), "--assist decodes one sequence", "--batch 2")
    _fails(_backbone(*base, "--assist", "draft"), "--assist draft needs --draft-model")
    _fails(_backbone(*base, "--draft-model", model), "--draft-model is for --assist draft")
    _fails(_backbone(*base, "--assist", "lookup", "--assist-tokens", "0"), "--assist-tokens")
    wide = make_tiny_checkpoint(tmp_path / "wide", seed=1, overrides={"vocab_size": 640, "num_hidden_layers": 1})
    _fails(_backbone(*base, "--assist", "draft", "--draft-model", str(wide)), "vocab_size 640", "512")


@pytest.mark.integration
def test_assist_refuses_a_cache_it_cannot_cut_back(tiny_models) -> None:  # type: ignore[no-untyped-def]
    # Linear-attention states cannot be cut back to the accepted drafts.
    _fails(_backbone("--model", str(tiny_models("qwen3_5_moe")), "--prompt", "x", "--max-new-tokens", "2",
                     "--assist", "lookup"), "--assist", "cannot be cut back")


def test_end_of_sequence_is_not_chosen() -> None:
    """The decode makes exactly the tokens asked for, as plain decoding (min_new_tokens) does:
    an end-of-sequence argmax gives way to the next best token; the logits stay the model's."""
    from backbone.engine._assist import _greedy

    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [3.0, 0.0, 1.0, 0.0]])
    assert _greedy(logits, [2]) == [3, 0]
    assert _greedy(logits, []) == [2, 0]
    assert logits[0, 2] == 5.0
