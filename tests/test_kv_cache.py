"""The KV cache that grows in place (kvasir_rpc/_kv_cache.py).

A ``GrowingLayer`` holds what transformers' ``DynamicLayer`` holds after any sequence of
appends, cuts, row selections and batchings (the engine's moves), while allocating rarely; and
a decode on it gives, token for token and logit for logit, what transformers' own ``generate``
gives on its ``DynamicCache``, for each family's attention (plain, linear attention beside,
MLA, sliding windows beside), and the serve engine's batch the same.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from kvasir_rpc._kv_cache import ROOM_TOKENS, GrowingLayer, growing_cache


def _states(batch: int, tokens: int, *, heads: int = 2, dim: int = 4, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, tokens, dim, generator=g),
            torch.randn(batch, heads, tokens, dim + 1, generator=g))  # values may be wider (MLA)


def _same(a: DynamicLayer, b: DynamicLayer) -> None:
    assert a.keys is not None and b.keys is not None and a.values is not None and b.values is not None
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert a.get_seq_length() == b.get_seq_length()


def test_appends_fill_one_buffer_and_hand_out_views_of_it() -> None:
    plain, growing = DynamicLayer(), GrowingLayer()
    for step, tokens in enumerate([5] + [1] * 200):
        k, v = _states(3, tokens, seed=step)
        want = plain.update(k, v)
        got = growing.update(k, v)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
        _same(plain, growing)
    # 205 tokens in buffers of 69, 134, 199 and 264 (room for 64 more each time: an eighth of
    # what they hold is less), against a new tensor per append for DynamicLayer.
    assert growing.reallocations == 4
    assert growing.keys is not None and not growing.keys.is_contiguous()  # a view of the buffer


def test_the_tokens_expected_take_one_buffer() -> None:
    growing = GrowingLayer(expected_tokens=7 + 300)
    for step, tokens in enumerate([7] + [1] * 300):
        growing.update(*_states(2, tokens, seed=step))
    assert growing.reallocations == 1 and growing.get_seq_length() == 307
    growing.update(*_states(2, 1, seed=999))  # one past what was expected: room is made
    assert growing.reallocations == 2 and growing.get_seq_length() == 308


def test_a_cut_keeps_the_buffer_and_the_next_tokens_overwrite_what_was_cut() -> None:
    plain, growing = DynamicLayer(), GrowingLayer()
    for layer in (plain, growing):
        layer.update(*_states(2, 10, seed=1))
        layer.update(*_states(2, 1, seed=2))
        layer.crop(-3)  # as transformers crops
        layer.keys, layer.values = layer.keys[..., :6, :], layer.values[..., :6, :]  # as cut_cache does
        layer.update(*_states(2, 1, seed=3))
    _same(plain, growing)
    assert growing.reallocations == 1


@pytest.mark.parametrize("seed", range(6))
def test_any_sequence_of_the_engines_moves_holds_what_a_dynamic_layer_holds(seed: int) -> None:
    """Appends, cuts, row selections with padding dropped, and batching with another cache
    (left-padded), in random order: the keys and values stay equal to DynamicLayer's."""
    from backbone.engine._batch import _pad_left

    rnd = random.Random(seed)
    plain, growing = DynamicLayer(), GrowingLayer()
    k, v = _states(4, 6, seed=seed)
    plain.update(k, v)
    growing.update(k, v)
    for step in range(60):
        move = rnd.choice(["append", "append", "append", "cut", "select", "batch"])
        n = plain.get_seq_length()
        if move == "append":
            k, v = _states(plain.keys.shape[0], rnd.choice([1, 1, 3]), seed=1000 * seed + step)
            plain.update(k, v)
            growing.update(k, v)
        elif move == "cut" and n > 2:
            keep = rnd.randrange(1, n)
            for layer in (plain, growing):
                layer.keys, layer.values = layer.keys[..., :keep, :], layer.values[..., :keep, :]
        elif move == "select" and plain.keys.shape[0] > 1:
            rows = torch.tensor(sorted(rnd.sample(range(plain.keys.shape[0]), plain.keys.shape[0] - 1)))
            pad = rnd.randrange(0, min(2, n))
            for layer in (plain, growing):
                layer.keys, layer.values = layer.keys[rows, :, pad:], layer.values[rows, :, pad:]
        elif move == "batch":
            other_k, other_v = _states(2, rnd.randrange(1, 9), seed=7000 + step)
            length = max(n, other_k.shape[-2])
            for layer in (plain, growing):
                layer.keys = torch.cat([_pad_left(layer.keys, length - n),
                                        _pad_left(other_k, length - other_k.shape[-2])])
                layer.values = torch.cat([_pad_left(layer.values, length - n),
                                          _pad_left(other_v, length - other_v.shape[-2])])
        _same(plain, growing)
    # Every append either fit in the room or made a buffer: far fewer than one per append.
    assert growing.reallocations <= 1 + 60 // 4 + 60 * 3 // ROOM_TOKENS + 1


def test_only_plain_attention_layers_grow_in_place(tiny_models) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_models("qwen3_5_moe"))
    cache = growing_cache(config)
    kinds = {type(layer).__name__ for layer in cache.layers}
    assert "GrowingLayer" in kinds and len(kinds) == 2  # linear-attention layers as transformers makes them


# -- decodes: the same tokens and logits as transformers' own generate ----------------------


def _generate_reference(model, enc, tokens: int):  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        out = model.generate(**enc, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                             return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    return out.sequences[:, enc["input_ids"].shape[1]:], torch.stack([x.float() for x in out.logits])


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss"])
def test_a_decode_on_the_growing_cache_is_transformers_generate_bit_for_bit(family, tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from backbone.engine._decode import decode, load_model, prompts_for_batch
    from kvasir.families import make_family_checkpoint

    path = tiny_models(family) if family in ("qwen3_moe", "qwen3_5_moe", "mixtral") else \
        make_family_checkpoint(tmp_path / family, family)
    model, tokenizer = load_model(path)
    prompts = prompts_for_batch("the swarm answers", 5)
    ours = decode(model, tokenizer, prompts, 12, implementation="grouped_mm")
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    tokens, logits = _generate_reference(model, enc, 12)  # transformers' DynamicCache
    assert torch.equal(ours.new_tokens, tokens)
    assert torch.equal(ours.logits, logits)


def test_the_serve_engines_batch_is_transformers_generate_token_for_token(tiny_models) -> None:  # type: ignore[no-untyped-def]
    """Requests of different lengths batched by the engine (prefilled together, rows leaving
    and joining the growing cache) against transformers' generate on each prompt alone."""
    from backbone.engine._batch import Engine, Request
    from backbone.engine._decode import load_model
    from backbone.experts._dispatch import Dispatcher

    model, tokenizer = load_model(tiny_models("qwen3_moe"))
    engine = Engine(model, tokenizer, Dispatcher(model, None), max_batch=6)  # experts: the local kernel
    try:
        prompts = [f"caller {i} asks" + " of the swarm" * (i % 3) for i in range(6)]
        lengths = [6 + 3 * (i % 3) for i in range(6)]
        streams = [engine.submit(Request(prompt_ids=tuple(tokenizer(p)["input_ids"]), max_tokens=n, ignore_eos=True))
                   for p, n in zip(prompts, lengths)]
        got = []
        for stream in streams:
            events = list(stream)
            assert events[-1].error is None, events[-1].error
            got.append([t for e in events for t in e.token_ids])
        for prompt, n, ids in zip(prompts, lengths, got):
            enc = tokenizer([prompt], return_tensors="pt")
            tokens, _ = _generate_reference(model, enc, n)  # the same experts kernel, its own cache
            assert ids == tokens[0].tolist()
    finally:
        engine.close()
