"""Expert SPEC strings, digests of expert weights, and the expert kernel.

The kernel tests hold the project's central promise: the experts path computed through
plan_routes + expert_forward (locally or after a codec round trip, as a worker does) is
bitwise equal to transformers' eager experts loop.
"""


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from kvasir_rpc._activation import _TORCH_ACTIVATIONS, get_activation
from kvasir_rpc._checkpoint import SpecError, expert_digest, format_slices, parse_expert_spec, slices_digest
from kvasir_rpc._codec import decode_tensor, encode_tensor
from kvasir_rpc._gen.kvasir.v1 import tensor_pb2
from kvasir_rpc._kernel import DispatchInputError, expert_forward, plan_routes, validate_dispatch

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- parse_expert_spec ---------------------------------------------------------------------


def _full(layers, experts):
    return {layer: tuple(experts) for layer in layers}


@pytest.mark.parametrize(
    "spec, num_layers, num_experts, expected",
    [
        ("all", 2, 3, _full(range(2), range(3))),
        ("0-3:0-15", 4, 16, _full(range(4), range(16))),
        ("0-3:0-15", 6, 32, _full(range(4), range(16))),
        ("*:0-7", 3, 16, _full(range(3), range(8))),
        ("*:*", 2, 2, _full(range(2), range(2))),
        ("0:1,2:3-4", 4, 8, {0: (1,), 2: (3, 4)}),
        ("2:3-4,0:1", 4, 8, {0: (1,), 2: (3, 4)}),
        ("0:0-3,0:2-5,1:1", 4, 8, {0: (0, 1, 2, 3, 4, 5), 1: (1,)}),
        ("0:5,0:5", 4, 8, {0: (5,)}),
        ("all,0:1", 2, 3, _full(range(2), range(3))),
        ("1:*,1-2:0", 4, 3, {1: (0, 1, 2), 2: (0,)}),
        (" 0 : 1 , 1:2 ", 4, 8, {0: (1,), 1: (2,)}),
        ("0:1,,", 4, 8, {0: (1,)}),
        ("3:7", 4, 8, {3: (7,)}),
        ("007:0", 8, 8, {7: (0,)}),
    ],
)
def test_parse_examples(spec, num_layers, num_experts, expected):
    out = parse_expert_spec(spec, num_layers, num_experts)
    assert out == expected
    assert list(out) == sorted(out)  # layers in ascending order


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "empty"),
        ("   ", "empty"),
        (",", "empty"),
        (" , ,", "empty"),
        ("5:0", r"layer 5 out of range: the model has 4 \(layers 0-3\)"),
        ("4:0", r"layer 4 out of range: the model has 4 \(layers 0-3\)"),
        ("0-9:0", r"layer 9 out of range.*0-3"),
        ("0:8", r"expert 8 out of range: the model has 8 \(experts 0-7\)"),
        ("3-1:0", "empty"),
        ("0:5-2", "empty"),
        ("a:b", "expected N, N-M or \\*"),
        ("1:2:3", "expected LAYERS:EXPERTS"),
        ("0", "expected LAYERS:EXPERTS"),
        ("ALL", "expected LAYERS:EXPERTS"),
        ("all:0", "expected N, N-M or \\*"),
        (":", "expected N, N-M or \\*"),
        ("0:", "expected N, N-M or \\*"),
        (":0", "expected N, N-M or \\*"),
        ("-1:0", "expected N, N-M or \\*"),
        ("0:1-", "expected N, N-M or \\*"),
        ("0:1-2-3", "expected N, N-M or \\*"),
        ("0:+1", "expected N, N-M or \\*"),
        ("0:1.0", "expected N, N-M or \\*"),
        ("0:1,5:0", "layer 5"),
    ],
)
def test_parse_errors(spec, match):
    with pytest.raises(SpecError, match=match):
        parse_expert_spec(spec, 4, 8)


@SETTINGS
@given(st.text(alphabet="0123456789-:*,al ", max_size=30) | st.text(max_size=30))
def test_any_text_parses_or_raises_spec_error(spec):
    try:
        out = parse_expert_spec(spec, 5, 9)
    except SpecError:
        return
    assert out and all(0 <= layer < 5 for layer in out)
    for experts in out.values():
        assert experts and list(experts) == sorted(set(experts)) and all(0 <= e < 9 for e in experts)


def test_very_long_number_raises_spec_error():
    with pytest.raises(SpecError):
        parse_expert_spec("0:" + "9" * 5000, 4, 8)


def slice_maps(max_layers=12, max_experts=40):
    return st.integers(1, max_layers).flatmap(
        lambda nl: st.integers(1, max_experts).flatmap(
            lambda ne: st.tuples(
                st.just(nl),
                st.just(ne),
                st.dictionaries(
                    st.integers(0, nl - 1), st.sets(st.integers(0, ne - 1), min_size=1), min_size=1
                ),
            )
        )
    )


@SETTINGS
@given(slice_maps())
def test_format_then_parse_round_trip(case):
    num_layers, num_experts, slices = case
    expected = {layer: tuple(sorted(e)) for layer, e in sorted(slices.items())}
    text = format_slices(slices)
    assert parse_expert_spec(text, num_layers, num_experts) == expected
    assert format_slices(expected) == text  # canonical: independent of input order and type


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=5))
def test_parse_then_format_is_canonical(items):
    spec = ",".join(f"{min(a, b)}-{max(a, b)}:{min(c, d)}-{max(c, d)}" for a, b, c, d in items)
    parsed = parse_expert_spec(spec, 6, 10)
    assert parse_expert_spec(format_slices(parsed), 6, 10) == parsed
    expected = {}
    for a, b, c, d in items:
        for layer in range(min(a, b), max(a, b) + 1):
            expected.setdefault(layer, set()).update(range(min(c, d), max(c, d) + 1))
    assert parsed == {k: tuple(sorted(v)) for k, v in sorted(expected.items())}


@pytest.mark.parametrize(
    "slices, text",
    [
        ({0: (0, 1, 2, 3), 1: (0, 1, 2, 3)}, "0:0-3,1:0-3"),
        ({0: (1, 3, 4)}, "0:1,0:3-4"),
        ({2: [9], 0: [5, 4]}, "0:4-5,2:9"),
        ({}, ""),
    ],
)
def test_format_examples(slices, text):
    assert format_slices(slices) == text


# --- digests -------------------------------------------------------------------------------


def _weights(seed=0, dtype=torch.float32, hidden=8, inter=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * inter, hidden, generator=g).to(dtype), torch.randn(hidden, inter, generator=g).to(dtype)


def test_expert_digest_equal_for_equal_tensors():
    gate_up, down = _weights()
    d = expert_digest(gate_up, down)
    assert len(d) == 32
    assert expert_digest(gate_up.clone(), down.clone()) == d
    # a non-contiguous tensor with the same values digests the same
    assert expert_digest(gate_up.t().contiguous().t(), down.t().contiguous().t()) == d
    assert expert_digest(*_weights()) == d


@SETTINGS
@given(which=st.sampled_from(["gate_up", "down"]), index=st.integers(0, 47), bits=st.integers(1, 2**31 - 1))
def test_expert_digest_changes_with_one_element(which, index, bits):
    gate_up, down = _weights()
    d = expert_digest(gate_up, down)
    t = gate_up if which == "gate_up" else down
    flat = t.view(-1).view(torch.int32)
    flat[index % flat.numel()] ^= bits
    assert expert_digest(gate_up, down) != d


def test_expert_digest_sees_negative_zero_dtype_shape_and_order():
    gate_up, down = _weights()
    d = expert_digest(gate_up, down)
    z = gate_up.clone()
    z[0, 0] = 0.0
    nz = z.clone()
    nz[0, 0] = -0.0
    assert expert_digest(z, down) != expert_digest(nz, down)
    assert expert_digest(gate_up.to(torch.bfloat16), down.to(torch.bfloat16)) != expert_digest(
        gate_up.to(torch.float16), down.to(torch.float16)
    )
    assert expert_digest(gate_up.reshape(6, 16), down) != d  # same bytes, other shape
    assert expert_digest(down, gate_up) != d


@SETTINGS
@given(
    st.dictionaries(
        st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)), st.binary(min_size=32, max_size=32), max_size=12
    ),
    st.randoms(use_true_random=False),
)
def test_slices_digest_is_order_independent(digests, rnd):
    items = list(digests.items())
    rnd.shuffle(items)
    assert slices_digest(dict(items)) == slices_digest(digests)
    assert len(slices_digest(digests)) == 32


def test_slices_digest_changes_with_keys_and_values():
    base = {(0, 1): b"\x01" * 32, (1, 0): b"\x02" * 32}
    d = slices_digest(base)
    assert slices_digest({(0, 1): b"\x01" * 32, (1, 1): b"\x02" * 32}) != d
    assert slices_digest({(0, 1): b"\x01" * 32, (1, 0): b"\x03" * 32}) != d
    assert slices_digest({(0, 1): b"\x01" * 32}) != d
    assert slices_digest({}) != d


# --- plan_routes ---------------------------------------------------------------------------


def _reference_routes(top_k_index, num_experts):
    """transformers' eager loop (Qwen3MoeExperts.forward), line for line."""
    out = []
    expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=num_experts + 1)
    expert_mask = expert_mask.permute(2, 1, 0)
    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        out.append((int(expert_idx), token_idx.tolist(), top_k_pos.tolist()))
    return out


@st.composite
def router_choices(draw, distinct=False):
    num_experts = draw(st.integers(1, 12))
    tokens = draw(st.integers(0, 20))
    k = draw(st.integers(1, min(4, num_experts) if distinct else 4))
    seed = draw(st.integers(0, 2**32 - 1))
    g = torch.Generator().manual_seed(seed)
    if distinct:
        rows = [torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)]
        idx = torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.long)
    else:
        # any index 0..E inclusive: E is the padding slot
        idx = torch.randint(0, num_experts + 1, (tokens, k), generator=g)
    return idx, num_experts


@SETTINGS
@given(router_choices())
def test_plan_routes_matches_the_eager_loop(case):
    idx, num_experts = case
    routes = plan_routes(idx, num_experts)
    got = [(r.expert, r.token_idx.tolist(), r.top_k_pos.tolist()) for r in routes]
    assert got == _reference_routes(idx, num_experts)
    experts = [r.expert for r in routes]
    assert experts == sorted(set(experts)) and num_experts not in experts
    for r in routes:
        assert r.token_idx.dtype == torch.int64 and r.top_k_pos.dtype == torch.int64
        assert bool((idx[r.token_idx, r.top_k_pos] == r.expert).all())
        pairs = list(zip(r.top_k_pos.tolist(), r.token_idx.tolist()))
        assert pairs == sorted(pairs)  # (slot, token) order
    # every non-padding choice is routed exactly once
    assert sum(r.token_idx.numel() for r in routes) == int((idx != num_experts).sum())


def test_plan_routes_skips_the_padding_index():
    idx = torch.tensor([[0, 3], [3, 3], [2, 0]])
    routes = plan_routes(idx, 3)
    assert [r.expert for r in routes] == [0, 2]
    assert routes[0].token_idx.tolist() == [0, 2] and routes[0].top_k_pos.tolist() == [0, 1]
    assert routes[1].token_idx.tolist() == [2] and routes[1].top_k_pos.tolist() == [0]
    assert plan_routes(torch.full((4, 2), 5), 5) == []
    assert plan_routes(torch.empty(0, 2, dtype=torch.long), 5) == []


def test_plan_routes_orders_rows_by_slot_then_token():
    idx = torch.tensor([[1, 0], [0, 1], [1, 0]])
    (r0, r1) = plan_routes(idx, 2)
    assert r0.expert == 0
    assert r0.top_k_pos.tolist() == [0, 1, 1] and r0.token_idx.tolist() == [1, 0, 2]
    assert r1.top_k_pos.tolist() == [0, 0, 1] and r1.token_idx.tolist() == [0, 2, 1]


# --- expert_forward vs. transformers -------------------------------------------------------

HIDDEN, INTER, EXPERTS, TOP_K = 32, 24, 8, 2


def _experts_module(dtype, seed=0, act="silu"):
    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        hidden_act=act,
        experts_implementation="eager",
    )
    module = Qwen3MoeExperts(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=g) * 0.2)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=g) * 0.2)
    return module.to(dtype).eval()


def _router_inputs(tokens, dtype, seed, pad=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    if pad and tokens:
        idx[0, 1] = EXPERTS  # one padding choice
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), dim=-1).to(dtype)
    return hidden, idx, weights


def _kvasir_forward(module, hidden, idx, weights, transport=lambda t: t):
    act = get_activation(module.config.hidden_act)
    out = torch.zeros_like(hidden)
    for r in plan_routes(idx, module.num_experts):
        rows = transport(hidden[r.token_idx])
        w = transport(weights[r.token_idx, r.top_k_pos])
        gate_up = transport(module.gate_up_proj[r.expert].detach().clone())
        down = transport(module.down_proj[r.expert].detach().clone())
        partial = transport(expert_forward(rows, gate_up, down, act, w))
        out.index_add_(0, r.token_idx, partial.to(out.dtype))
    return out


def _wire(t):
    msg = tensor_pb2.Tensor()
    msg.ParseFromString(encode_tensor(t).SerializeToString())
    return decode_tensor(msg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("pad", [False, True])
def test_expert_forward_equals_transformers_eager_bitwise(dtype, tokens, pad):
    module = _experts_module(dtype, seed=tokens)
    hidden, idx, weights = _router_inputs(tokens, dtype, seed=tokens + 1, pad=pad)
    with torch.no_grad():
        ref = module(hidden, idx, weights)
        out = _kvasir_forward(module, hidden, idx, weights)
    assert out.dtype == ref.dtype
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_expert_forward_after_the_wire_equals_local(dtype):
    # Remote equals local: every tensor crossing the codec (as a worker sees it) gives the
    # same bits, atol=0.
    module = _experts_module(dtype, seed=7)
    hidden, idx, weights = _router_inputs(40, dtype, seed=8)
    with torch.no_grad():
        ref = module(hidden, idx, weights)
        out = _kvasir_forward(module, hidden, idx, weights, transport=_wire)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_expert_forward_with_other_activations(act):
    module = _experts_module(torch.float32, seed=3, act=act)
    # The same function as transformers' (tests/test_kernel.py: bitwise, for those taken
    # from torch directly); the forward below checks it through the whole expert.
    if act not in _TORCH_ACTIVATIONS:
        assert type(get_activation(act)) is type(module.act_fn)
    hidden, idx, weights = _router_inputs(16, torch.float32, seed=4)
    with torch.no_grad():
        assert torch.equal(_kvasir_forward(module, hidden, idx, weights), module(hidden, idx, weights))


def test_eager_loop_order_observed_in_transformers(monkeypatch):
    # Watch the rows transformers actually feeds each expert (hidden[:, 0] carries the
    # token number) and compare with plan_routes: same experts, same row order.
    module = _experts_module(torch.float32)
    tokens = 12
    hidden, idx, weights = _router_inputs(tokens, torch.float32, seed=11, pad=True)
    hidden[:, 0] = torch.arange(tokens, dtype=torch.float32)
    seen = []
    real_linear = torch.nn.functional.linear
    gate_up_ptrs = {module.gate_up_proj[e].data_ptr(): e for e in range(EXPERTS)}

    def spy(x, w, *args, **kwargs):
        if w.data_ptr() in gate_up_ptrs and w.shape == (2 * INTER, HIDDEN):
            seen.append((gate_up_ptrs[w.data_ptr()], x[:, 0].to(torch.int64).tolist()))
        return real_linear(x, w, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    with torch.no_grad():
        module(hidden, idx, weights)
    monkeypatch.undo()
    assert seen and seen == [(r.expert, r.token_idx.tolist()) for r in plan_routes(idx, EXPERTS)]


def test_batched_segments_equal_per_expert_calls():
    # A worker receives one request with rows grouped by expert (segments); computing each
    # segment on its slice of the decoded batch gives the bits of separate calls.
    module = _experts_module(torch.bfloat16, seed=5)
    hidden, idx, weights = _router_inputs(30, torch.bfloat16, seed=6)
    act = get_activation("silu")
    routes = plan_routes(idx, EXPERTS)
    batch = _wire(torch.cat([hidden[r.token_idx] for r in routes]))
    wts = _wire(torch.cat([weights[r.token_idx, r.top_k_pos] for r in routes]))
    validate_dispatch(
        batch, wts, [(r.expert, r.token_idx.numel()) for r in routes], hidden_size=HIDDEN, dtype=torch.bfloat16, max_rows=1000
    )
    start = 0
    with torch.no_grad():
        for r in routes:
            n = r.token_idx.numel()
            gu, dn = module.gate_up_proj[r.expert], module.down_proj[r.expert]
            seg = expert_forward(batch[start : start + n], gu, dn, act, wts[start : start + n])
            alone = expert_forward(hidden[r.token_idx], gu, dn, act, weights[r.token_idx, r.top_k_pos])
            assert torch.equal(seg, alone)
            start += n
    assert start == batch.shape[0]


def test_expert_forward_shapes_and_scaling():
    gate_up, down = _weights(hidden=HIDDEN, inter=INTER)
    x = torch.randn(5, HIDDEN)
    act = get_activation("silu")
    ones = expert_forward(x, gate_up, down, act, torch.ones(5))
    assert ones.shape == (5, HIDDEN)
    zeros = expert_forward(x, gate_up, down, act, torch.zeros(5))
    assert torch.equal(zeros, torch.zeros(5, HIDDEN))
    empty = expert_forward(torch.empty(0, HIDDEN), gate_up, down, act, torch.empty(0))
    assert empty.shape == (0, HIDDEN)


# --- validate_dispatch ---------------------------------------------------------------------


def _good(rows=6, hidden_size=HIDDEN, dtype=torch.bfloat16):
    return dict(
        hidden=torch.randn(rows, hidden_size).to(dtype),
        weights=torch.rand(rows),
        segments=[(0, 2), (3, 4)],
    )


def _check(hidden, weights, segments, **kw):
    kw.setdefault("hidden_size", HIDDEN)
    kw.setdefault("dtype", torch.bfloat16)
    kw.setdefault("max_rows", 64)
    validate_dispatch(hidden, weights, segments, **kw)


def test_validate_dispatch_accepts_a_good_request():
    _check(**_good())
    _check(**_good(), max_rows=6)
    _check(hidden=torch.empty(0, HIDDEN, dtype=torch.bfloat16), weights=torch.empty(0), segments=[])


def _nan(t, value):
    t = t.clone()
    t.view(-1)[3] = value
    return t


BAD = {
    "wide": lambda g: dict(g, hidden=torch.randn(6, HIDDEN + 1).bfloat16()),
    "narrow": lambda g: dict(g, hidden=torch.randn(6, HIDDEN - 1).bfloat16()),
    "1d": lambda g: dict(g, hidden=torch.randn(6 * HIDDEN).bfloat16()),
    "3d": lambda g: dict(g, hidden=torch.randn(1, 6, HIDDEN).bfloat16()),
    "float32": lambda g: dict(g, hidden=g["hidden"].float()),
    "float16": lambda g: dict(g, hidden=g["hidden"].half()),
    "int64": lambda g: dict(g, hidden=torch.zeros(6, HIDDEN, dtype=torch.int64)),
    "too_many_rows": lambda g: dict(g, hidden=torch.randn(65, HIDDEN).bfloat16(), weights=torch.rand(65), segments=[(0, 65)]),
    "weights_short": lambda g: dict(g, weights=torch.rand(5)),
    "weights_long": lambda g: dict(g, weights=torch.rand(7)),
    "weights_2d": lambda g: dict(g, weights=torch.rand(6, 1)),
    "weights_int": lambda g: dict(g, weights=torch.ones(6, dtype=torch.int32)),
    "segments_short": lambda g: dict(g, segments=[(0, 2), (3, 3)]),
    "segments_long": lambda g: dict(g, segments=[(0, 2), (3, 5)]),
    "segments_none": lambda g: dict(g, segments=[]),
    "segment_zero": lambda g: dict(g, segments=[(0, 2), (1, 0), (3, 4)]),
    "hidden_nan": lambda g: dict(g, hidden=_nan(g["hidden"], float("nan"))),
    "hidden_inf": lambda g: dict(g, hidden=_nan(g["hidden"], float("inf"))),
    "hidden_ninf": lambda g: dict(g, hidden=_nan(g["hidden"], -float("inf"))),
    "weights_nan": lambda g: dict(g, weights=_nan(g["weights"], float("nan"))),
    "weights_inf": lambda g: dict(g, weights=_nan(g["weights"], float("inf"))),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_validate_dispatch_refuses(case):
    with pytest.raises(DispatchInputError) as exc:
        _check(**BAD[case](_good()))
    assert exc.value.precondition is False
    assert str(exc.value)


def test_validate_dispatch_messages_are_actionable():
    with pytest.raises(DispatchInputError, match=rf"shape \[rows, {HIDDEN}\], got \[6, {HIDDEN + 1}\]"):
        _check(**BAD["wide"](_good()))
    with pytest.raises(DispatchInputError, match="must be torch.bfloat16, got torch.float32"):
        _check(**BAD["float32"](_good()))
    with pytest.raises(DispatchInputError, match=r"weights must have shape \[6\], got \[5\]"):
        _check(**BAD["weights_short"](_good()))
    with pytest.raises(DispatchInputError, match="segments cover 5 rows, hidden has 6"):
        _check(**BAD["segments_short"](_good()))
    with pytest.raises(DispatchInputError, match="65 rows in one call, at most 64"):
        _check(**BAD["too_many_rows"](_good()))
    with pytest.raises(DispatchInputError, match="NaN or Inf"):
        _check(**BAD["weights_nan"](_good()))


@SETTINGS
@given(
    width=st.one_of(st.just(HIDDEN), st.integers(1, 40)),
    weights_delta=st.sampled_from([0, 0, 0, 1, -1]),
    segs=st.lists(st.integers(0, 6), max_size=4),
    extra_rows=st.sampled_from([0, 0, 0, 1, -1]),
)
def test_validate_dispatch_accepts_exactly_the_consistent_requests(width, weights_delta, segs, extra_rows):
    rows = max(sum(segs) + extra_rows, 0)
    n_weights = max(rows + weights_delta, 0)
    hidden = torch.zeros(rows, width, dtype=torch.bfloat16)
    weights = torch.zeros(n_weights)
    segments = [(i, n) for i, n in enumerate(segs)]
    ok = width == HIDDEN and n_weights == rows and sum(segs) == rows and 0 not in segs
    try:
        _check(hidden, weights, segments)
    except DispatchInputError:
        assert not ok
    else:
        assert ok


@SETTINGS
@given(
    values=st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                              st.sampled_from([3.0e38, -3.0e38, 65504.0])), min_size=0, max_size=40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_all_finite_agrees_with_the_elementwise_check(values, dtype):
    """The one-reduction finiteness check says exactly what isfinite().all() says, also
    when huge finite values overflow the sum (3e38 + 3e38) or the narrow dtype."""
    from kvasir_rpc._kernel import all_finite

    t = torch.tensor(values, dtype=torch.float32).to(dtype)
    assert all_finite(t) == bool(torch.isfinite(t).all())


def test_validate_dispatch_with_row_index():
    hidden = torch.zeros(3, HIDDEN, dtype=torch.bfloat16)
    segs = [(0, 2), (1, 3)]
    _check(hidden=hidden, weights=torch.zeros(5), segments=segs, row_index=torch.tensor([2, 0, 0, 1, 2]))
    with pytest.raises(DispatchInputError, match="row_index names row 3, hidden has 3 rows"):
        _check(hidden=hidden, weights=torch.zeros(5), segments=segs, row_index=torch.tensor([3, 0, 0, 1, 2]))
    with pytest.raises(DispatchInputError, match="row_index has 4 entries, segments cover 5 rows"):
        _check(hidden=hidden, weights=torch.zeros(5), segments=segs, row_index=torch.tensor([0, 0, 1, 2]))
    with pytest.raises(DispatchInputError, match=r"weights must have shape \[5\], got \[3\]"):
        _check(hidden=hidden, weights=torch.zeros(3), segments=segs, row_index=torch.tensor([2, 0, 0, 1, 2]))
    with pytest.raises(DispatchInputError, match="65 rows in one call, at most 64"):
        _check(hidden=hidden, weights=torch.zeros(65), segments=[(0, 65)], row_index=torch.zeros(65, dtype=torch.long))


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("offset", [1, 2, 3, 5, 7])
def test_expert_forward_is_the_same_function_at_any_alignment(rows, offset):
    """A worker computes on a view into the received message, at any address; the backbone on
    fresh tensors. Some CPU kernels round differently for unaligned operands (AVX2, AMD EPYC):
    the kernel aligns them, so the bits depend on the values alone."""
    import torch.nn.functional as F

    from kvasir_rpc._kernel import expert_forward

    g = torch.Generator().manual_seed(rows * 10 + offset)
    x = torch.randn(rows, 64, generator=g)
    gate_up, down, w = torch.randn(64, 64, generator=g) * 0.02, torch.randn(64, 32, generator=g) * 0.02, torch.rand(rows)
    buf = torch.empty(rows * 64 + offset)
    buf[offset:] = x.reshape(-1)
    shifted = buf[offset:].view(rows, 64)
    assert shifted.data_ptr() % 64 != 0
    assert torch.equal(expert_forward(x, gate_up, down, F.silu, w), expert_forward(shifted, gate_up, down, F.silu, w))
