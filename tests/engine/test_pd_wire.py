"""The PD control channel's wire format (disaggregation/wire.py, protocol.py): every message kind
goes over and comes back equal, with its tensors; nothing but a WireError comes out of decoding
hostile bytes (pickles, garbage, lying headers: a property-based fuzz); what passes the schemas is
still checked against the reservation before it touches a pool (mem/transfer.py check_rows) and
a result's tensors are checked before the decode side uses them."""
from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pd_fixtures import Exploit

from sparkserve.disaggregation import protocol as p
from sparkserve.disaggregation.control import _result, shape_list, shapes_of
from sparkserve.disaggregation.wire import WireError, pack, unpack
from sparkserve.mem.transfer import check_rows

SHAPES = {(0, "k", 0): ("token_page", (2, 4)), (0, "v", 0): ("token_page", (2, 4)),
          (0, "state", 1): ("request_row", (3, 5)), (1, "k", 0): ("token_page", (1, 8))}
BUFFER = p.Buffer(kind="token_page", dtype="float32", row_shape=(2, 4), ptr=1 << 40, row_bytes=32, stride=32,
                  rows=100)
ROWS = {(0, "k", 0): torch.randn(6, 2, 4), (0, "v", 0): torch.randn(6, 2, 4).half(),
        (0, "state", 1): torch.randn(1, 3, 5), (1, "k", 0): torch.zeros(0, 1, 8)}


def _messages():
    """One of every kind, with the tensors it travels with."""
    rng = torch.Generator().get_state()
    hidden = {("hidden", 0, "positions"): torch.arange(3), ("hidden", 0, "final"): torch.randn(3, 16),
              ("hidden", 0, "taps"): torch.randn(3, 48)}
    return [
        (p.Reserve(room=(1 << 63) - 1, start=3, shapes=shape_list(SHAPES), backend="tcp"), {}),
        (p.Reserve(room=1, start=0, shapes=[], backend="nixl", dst=p.Destination(row=4, split=True)),
         {("slots",): torch.arange(7), ("swa_slots",): torch.arange(7) * 2}),
        (p.Cancel(room=2, message="the client went away ✓"), {}),
        (p.Bye(), {}),
        (p.Hello(host="10.0.0.2", layout=[[BUFFER, BUFFER], []], whole=True),
         {("meta",): torch.frombuffer(bytearray(b"\x00agent\xff"), dtype=torch.uint8)}),
        (p.RowsSent(room=3, lo=2), ROWS),
        (p.RowsSent(room=3, lo=2, hi=9), {}),
        (p.Result(room=4, output_ids=[7], output_logprobs=[float("-inf")],
                  output_top_logprobs=[[(7, -0.5), (9, float("-inf"))]], hidden_parts=1),
         {("rng",): rng, **hidden}),
        (p.Failed(room=5, message="prefill failed"), {}),
        (p.Refused(room=6, message="pool 0 mismatch"), {}),
        (p.Alive(rooms=[1, 2, 3]), {}),
        (p.Rehello(room=7), {}),
    ]


@pytest.mark.parametrize("msg,tensors", _messages(), ids=lambda x: getattr(x, "kind", ""))
def test_every_message_goes_over_and_back(msg, tensors):
    frames = [bytes(f) for f in pack(msg, tensors)]
    got, got_tensors = unpack(frames)
    assert got == msg
    assert got_tensors.keys() == tensors.keys()
    for key, t in tensors.items():
        assert got_tensors[key].dtype == t.dtype and torch.equal(got_tensors[key], t)


def test_reservation_shapes_round_trip():
    [(msg, _)] = [m for m in _messages()[:1]]
    assert shapes_of(unpack(pack(msg))[0]) == SHAPES


def test_a_pickle_is_refused_and_never_runs(tmp_path):
    marker = str(tmp_path / "pwned")
    payload = pickle.dumps({"kind": "reserve", "x": Exploit(marker)})
    with pytest.raises(WireError, match="not a PD message"):
        unpack([payload])
    with pytest.raises(WireError):
        unpack([json.dumps({"msg": {"kind": "bye"}, "tensors": []}).encode(), payload])
    assert not os.path.exists(marker)


def _header(msg: dict, tensors: list | None = None) -> bytes:
    return json.dumps({"msg": msg, "tensors": tensors or []}).encode()


def _rows(dtype, shape: list[int], n: int = 1) -> bytes:
    return _header({"kind": "rows", "room": 1, "lo": 0}, [{"key": ["a"], "dtype": dtype, "shape": shape}] * n)


@pytest.mark.parametrize("frames,why", [
    ([], "an empty message"),
    ([b"\x80\x04garbage"], "not a PD message"),
    ([_header({"kind": "exec", "room": 1})], "not a PD message"),
    ([_header({"kind": "cancel", "room": -1, "message": ""})], "room"),
    ([_header({"kind": "cancel", "room": 1 << 63, "message": ""})], "room"),
    ([_header({"kind": "cancel", "room": "1", "message": ""})], "room"),
    ([_header({"kind": "cancel", "room": 1, "message": "x", "extra": 1})], "extra"),
    ([_header({"kind": "cancel", "room": 1, "message": "x" * 5000})], "message"),
    ([_rows("object", [1]), b"\0" * 8], "dtype"),
    ([_rows("float32", [1 << 39] * 3), b"\0" * 8], "bytes for float32"),
    ([_rows("float32", [2])], "0 tensor frames for 1"),
    ([_rows("uint8", [1], 2), b"\0", b"\0"], "twice"),
    ([_header({"kind": "alive", "rooms": list(range(p.MAX_ITEMS + 1))})], "rooms"),
    ([b"{" * 100_000], "not a PD message"),
    ([b" " * (17 << 20)], "header of"),
])
def test_lying_messages_are_refused(frames, why):
    with pytest.raises(WireError, match=why):
        unpack(frames)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=4), max_leaves=20)
_kinds = st.sampled_from(["reserve", "cancel", "bye", "hello", "rows", "result", "failed", "refused", "alive",
                          "rehello", "other"])


@st.composite
def _hostile(draw):
    """Frames an attacker might send: raw bytes, JSON of any shape, or a valid message's header
    with its fields and tensors tampered with."""
    how = draw(st.integers(0, 2))
    if how == 0:
        return draw(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
    if how == 1:
        msg = draw(st.dictionaries(st.text(max_size=10), _json, max_size=5))
        msg["kind"] = draw(_kinds)
        spec = st.fixed_dictionaries({"key": _json, "dtype": _json, "shape": _json})
        tensors = draw(st.lists(spec, max_size=2))
        return [_header(msg, tensors)] + draw(st.lists(st.binary(max_size=32), max_size=3))
    msg, tensors = draw(st.sampled_from(_messages()))
    frames = [bytes(f) for f in pack(msg, tensors)]
    header = json.loads(frames[0])
    field = draw(st.sampled_from(sorted(header["msg"]) + ["tensors"]))
    if field == "tensors" and header["tensors"]:
        spec = header["tensors"][draw(st.integers(0, len(header["tensors"]) - 1))]
        spec[draw(st.sampled_from(["key", "dtype", "shape"]))] = draw(_json)
    else:
        header["msg"][field] = draw(_json)
    frames[0] = json.dumps(header).encode()
    if len(frames) > 1 and draw(st.booleans()):
        frames.pop(draw(st.integers(1, len(frames) - 1)))
    return frames


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_hostile())
def test_decoding_hostile_frames_raises_nothing_but_wire_errors(frames):
    try:
        msg, tensors = unpack(frames)
    except WireError:
        return
    assert isinstance(msg, p._Message)       # what passes is a typed message with typed tensors
    for t in tensors.values():
        assert isinstance(t, torch.Tensor)


def test_rows_are_checked_against_the_reservation():
    check_rows(ROWS, SHAPES, lo=2, positions=8)
    with pytest.raises(ValueError, match="positions 2..8 .* where 7 are reserved"):
        check_rows(ROWS, SHAPES, lo=2, positions=7)
    with pytest.raises(ValueError, match=r"rows of \[2, 5\] sent for pool 0 k of layer 0, which holds"):
        check_rows({(0, "k", 0): torch.zeros(1, 2, 5)}, SHAPES, 0, 8)
    with pytest.raises(ValueError, match="2 request rows"):
        check_rows({(0, "state", 1): torch.zeros(2, 3, 5)}, SHAPES, 0, 8)
    with pytest.raises(ValueError, match="does not hold"):
        check_rows({(0, "k", 9): torch.zeros(1, 2, 4)}, SHAPES, 0, 8)
    check_rows({(2, "draft", 0): torch.zeros(1, 2)}, SHAPES, 0, 8)     # a draft's pool the sender alone has


def test_a_result_is_checked_before_it_is_used():
    msg, tensors = _messages()[7]
    got = _result(*unpack(pack(msg, tensors)))
    assert got["output_ids"] == [7] and torch.equal(got["rng"], tensors[("rng",)])
    assert torch.equal(got["hidden"][0][1], tensors[("hidden", 0, "final")])
    bad = [{**tensors, ("rng",): torch.zeros(16, dtype=torch.uint8)},
           {k: v for k, v in tensors.items() if k != ("hidden", 0, "final")},
           {**tensors, ("hidden", 0, "taps"): torch.zeros(2, 48)},
           {**tensors, ("extra",): torch.zeros(1)}]
    for t in bad:
        with pytest.raises(ValueError):
            _result(*unpack(pack(msg, t)))
