"""The engine's pure parts: what text may be sent before a stop string is ruled out, and
how a sampled token is drawn (top-k, top-p, the request's own generator)."""

from __future__ import annotations

import torch

from backbone._engine import Sampling, _certain_end, _sample


def test_text_that_may_begin_a_stop_string_or_a_character_is_held_back():
    assert _certain_end("hello wor", ()) == 9
    assert _certain_end("hello wor", ("world",)) == 6  # "wor" may become "world"
    assert _certain_end("hello w", ("world", "xyz")) == 6
    assert _certain_end("hello", ("world",)) == 5
    assert _certain_end("caf\ufffd", ()) == 3  # half a character: the rest comes with the next token
    assert _certain_end("ab", ("abc", "b")) == 0  # "ab" may begin "abc"


def test_top_k_and_top_p_keep_only_the_likely_tokens_and_a_seed_repeats_the_draw():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    g = torch.Generator().manual_seed(0)
    drawn = {_sample(logits, Sampling(temperature=1.0, top_k=2), g) for _ in range(200)}
    assert drawn == {0, 1}
    # probabilities ~0.64, 0.24, 0.09...: top_p 0.7 keeps the first two (0.64 < 0.7).
    drawn = {_sample(logits, Sampling(temperature=1.0, top_p=0.7), g) for _ in range(200)}
    assert drawn == {0, 1}
    drawn = {_sample(logits, Sampling(temperature=1.0, top_p=0.5), g) for _ in range(50)}
    assert drawn == {0}  # the first token always stays
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [_sample(logits, Sampling(temperature=1.5), g1) for _ in range(20)] == \
           [_sample(logits, Sampling(temperature=1.5), g2) for _ in range(20)]
