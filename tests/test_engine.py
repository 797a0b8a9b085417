"""The engine: what text may be sent before a stop string is ruled out, how a sampled token
is drawn (top-k, top-p, the request's own generator), and, in process on the tiny
checkpoints, that a batch returns what each request returns alone on every cache layout."""

from __future__ import annotations

import pytest
import torch

from backbone.engine._batch import Sampling, _certain_end, _sample


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


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen3_5_moe"])
def test_a_batch_of_requests_returns_what_each_returns_alone_on_every_cache_layout(arch, tiny_models):
    """In process, experts local: 12 greedy requests of different lengths arriving together
    (prefilled together where the cache allows, Qwen3.5's linear-attention states one at a
    time) against each alone, and their padding keeps out of the experts path."""
    from backbone.engine._batch import Engine, Request
    from backbone.engine._decode import load_model
    from backbone.experts._dispatch import Dispatcher

    model, tokenizer = load_model(tiny_models(arch))
    engine = Engine(model, tokenizer, Dispatcher(model, None), max_batch=12)
    try:
        requests = [Request(prompt_ids=tuple(tokenizer(f"request {i}" + " of the swarm" * (i % 4))["input_ids"]),
                            max_tokens=8, ignore_eos=True) for i in range(12)]

        def run(streams):  # type: ignore[no-untyped-def]
            out = []
            for stream in streams:
                events = list(stream)
                assert events[-1].error is None, events[-1].error
                out.append(([t for e in events for t in e.token_ids], events[-1].summary))
            return out

        alone = [run([engine.submit(r)])[0] for r in requests]
        together = run([engine.submit(r) for r in requests])
        assert [ids for ids, _ in together] == [ids for ids, _ in alone]
        assert max(s.max_batch_size for _, s in together) > 1
        # The same expert rows as alone: none for padding.
        assert [s.local_rows for _, s in together] == [s.local_rows for _, s in alone]
        assert engine.pad_prefill == (arch != "qwen3_5_moe")
    finally:
        engine.close()
