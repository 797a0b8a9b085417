"""Compact announced slices (ExpertSet), the model shape a hub checks hellos against, and the
address key per-address caps count under. All in-process, no I/O but a temp config.json."""

import json
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvasir_rpc import (
    HELLO_SIGNATURE_DOMAIN,
    CloseCode,
    ExpertSet,
    HubHandshake,
    ModelShape,
    RemoteProtocolError,
    Wallet,
    WorkerHandshake,
    address_key,
    read_model_shape,
    remote_host,
    session_pb2,
    slices_from_proto,
    slices_to_proto,
)
from kvasir_rpc.protocol import MAX_EXPERTS_PER_LAYER

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
IDS = st.lists(st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1)), max_size=200)


@SETTINGS
@given(IDS)
def test_expert_set_behaves_as_the_sorted_tuple_of_its_ids(raw):
    ids = tuple(sorted(set(raw)))
    s = ExpertSet.of(raw)
    assert ExpertSet.from_sorted(ids) == s and s == ids and s == list(ids) and hash(s) == hash(ids)
    assert tuple(s) == ids and s.to_list() == list(ids) and len(s) == len(ids)
    assert s[:3] == ids[:3] and (not ids or s[-1] == ids[-1])
    probes = set(ids[:20]) | {0, 1, 2**32 - 1} | {i + 1 for i in ids[:20]}
    for p in probes:
        assert (p in s) == (p in ids)
    assert -1 not in s and 2**32 not in s and "1" not in s
    assert s.nbytes <= 4 * len(ids)  # never more than the ids themselves as uint32


def test_expert_set_picks_the_smallest_form():
    assert ExpertSet.from_sorted(range(MAX_EXPERTS_PER_LAYER)).nbytes == 8  # one run
    assert ExpertSet.from_sorted(range(0, 512, 2)).nbytes == 64  # a bitset over 0..511
    assert ExpertSet.from_sorted([5, 2**31, 2**32 - 1]).nbytes == 12  # sparse: the ids
    assert ExpertSet.of([]).nbytes == 0 and len(ExpertSet.of([])) == 0 and list(ExpertSet.of([])) == []


def test_expert_set_from_sorted_refuses_unsorted_or_repeated():
    for bad in ([2, 1], [1, 1], [0, 5, 5, 6]):
        with pytest.raises(ValueError, match="sorted and unique"):
            ExpertSet.from_sorted(bad)
    with pytest.raises(ValueError, match="uint32"):
        ExpertSet.of([-1])


def test_expert_set_is_much_smaller_than_a_tuple_of_ints():
    ids = list(range(0, 2 * MAX_EXPERTS_PER_LAYER, 2))  # no runs at all
    s = ExpertSet.from_sorted(ids)
    assert s.nbytes == MAX_EXPERTS_PER_LAYER // 4  # a bitset: 16 KiB
    as_tuple = sys.getsizeof(tuple(ids)) + sum(sys.getsizeof(i) for i in ids)
    assert as_tuple > 100 * (s.nbytes + sys.getsizeof(s))


def test_slices_round_trip_through_the_proto():
    slices = {0: ExpertSet.of([3, 1, 2]), 5: ExpertSet.of(range(0, 100, 3))}
    items = slices_to_proto(slices)
    assert [(i.layer, list(i.experts)) for i in items] == [(0, [1, 2, 3]), (5, list(range(0, 100, 3)))]
    assert slices_from_proto(items) == slices


SHAPE = ModelShape(layers=4, experts=8)


@pytest.mark.parametrize("layer, experts, match", [
    (4, [0], "layer 4 is not in the model served (4 layers)"),
    (0, [1, 8], "layer 0: expert 8 is not in the model served (8 experts per layer)"),
    (3, [2**32 - 1], "expert 4294967295 is not in the model served"),
])
def test_slices_outside_the_model_are_refused(layer, experts, match):
    items = [session_pb2.ExpertSlice(layer=layer, experts=experts)]
    slices_from_proto(items)  # inside the protocol's bounds
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        slices_from_proto(items, SHAPE)


def test_a_whole_model_fits():
    items = [session_pb2.ExpertSlice(layer=layer, experts=range(8)) for layer in range(4)]
    assert slices_from_proto(items, SHAPE) == {layer: tuple(range(8)) for layer in range(4)}


def test_hub_handshake_refuses_a_hello_outside_its_model_with_4102():
    hub_key, wallet = Wallet.generate(), Wallet.generate()
    hub = HubHandshake(hub_key, shape=SHAPE)
    worker = WorkerHandshake(wallet, slices={0: [1], 9: [0]}, weights_digest=bytes(32), device="cpu")
    hello = worker.receive_challenge(hub.challenge())
    with pytest.raises(RemoteProtocolError) as exc:
        hub.receive_hello(hello)
    assert exc.value.close_code == CloseCode.OUTSIDE_MODEL  # permanent: the same hello gets the same answer
    assert "layer 9 is not in the model served" in exc.value.reason
    assert HELLO_SIGNATURE_DOMAIN  # the hello was signed: the refusal is the shape's, not the signature's


def test_read_model_shape_reads_config_json_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 49, "num_experts": 256}))
    assert read_model_shape(tmp_path) == ModelShape(49, 256)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 2, "num_local_experts": 8}}))
    assert read_model_shape(tmp_path) == ModelShape(2, 8)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="not a Mixture-of-Experts config"):
        read_model_shape(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config.json"):
        read_model_shape(tmp_path)
    with pytest.raises(ValueError, match="not found"):
        read_model_shape(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="at least one layer"):
        ModelShape(0, 8)


@pytest.mark.parametrize("host, key", [
    ("203.0.113.7", "203.0.113.7"),
    ("127.0.0.1", "127.0.0.1"),
    ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff::1", "2001:db8:1:2::/64"),
    ("[2001:db8:1:3::1]", "2001:db8:1:3::/64"),
    ("fe80::1%eth0", "fe80::/64"),
    ("::ffff:203.0.113.7", "203.0.113.7"),
    ("::1", "::/64"),
    ("not-an-ip", "not-an-ip"),
])
def test_address_key(host, key):
    assert address_key(host) == key


@pytest.mark.parametrize("remote, host", [
    ("127.0.0.1:5555", "127.0.0.1"),
    ("gateway:203.0.113.7:443", "203.0.113.7"),
    ("gateway:2001:db8::1:443", "2001:db8::1"),
    ("[2001:db8::1]:443", "2001:db8::1"),
    ("gateway:[2001:db8::1]:443", "2001:db8::1"),
    ("/run/kvasir.sock", "/run/kvasir.sock"),
])
def test_remote_host(remote, host):
    assert remote_host(remote) == host


def test_same_slash_64_shares_a_key_and_others_do_not():
    a, b, c = (address_key(remote_host(r)) for r in
               ("gateway:2001:db8:0:1::a:1", "gateway:2001:db8:0:1:ffff::b:2", "gateway:2001:db8:0:2::a:1"))
    assert a == b != c
    assert np.uint32(3) in ExpertSet.of([3])  # numpy ids are ids too
