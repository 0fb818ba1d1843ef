"""The framework-free protocol rules, tested without I/O."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from streamkeep.protocol import cursor, headers, jsonmode, offsets, sse
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Headers
from streamkeep.protocol.names import check_stream_name, parse_stream_name
from streamkeep.protocol.state_fold import StateFold
from streamkeep.protocol.stream import (
    AppendOutcome,
    AppendPlan,
    AppendSpec,
    CreateSpec,
    ProducerMark,
    ProducerState,
    StreamMeta,
    StreamState,
    apply_append,
    copy_meta,
    plan_append,
)


def state(content_type: str = "text/plain", **meta_fields: object) -> StreamState:
    meta = StreamMeta(name="s", stream_id="id", content_type=content_type, created_at=0.0, **meta_fields)
    return StreamState(meta)


def append_spec(body: bytes = b"x", **kw: object) -> AppendSpec:
    values: dict[str, object] = {
        "content_type": "text/plain",
        "body": body,
        "close": False,
        "producer": None,
        "stream_seq": None,
    }
    values.update(kw)
    return AppendSpec(**values)  # type: ignore[arg-type]


def producer(pid: str = "p", epoch: int = 0, seq: int = 0) -> headers.ProducerHeaders:
    return headers.ProducerHeaders(pid, epoch, seq)


def status_of(fn, *args):  # type: ignore[no-untyped-def]
    with pytest.raises(ProtocolError) as caught:
        fn(*args)
    return caught.value.status


# ---- offsets -------------------------------------------------------------------------------


def test_offsets_sort_as_positions_and_round_trip() -> None:
    positions = [0, 1, 9, 10, 255, 4096, 2**40, 10**16 - 1]
    incarnation = offsets.incarnation_of("a1b2c3d4e5f6")
    tokens = [offsets.encode(p, incarnation) for p in positions]
    assert tokens == sorted(tokens)
    assert [offsets.decode(t) for t in tokens] == [offsets.Offset(incarnation, p) for p in positions]
    assert all(t not in ("-1", "now") and len(t) == 33 for t in tokens)
    assert offsets.encode(0) == "0000000000000000_0000000000000000"  # the hand-written beginning


def test_incarnations_are_never_zero_and_differ_between_stream_ids() -> None:
    ids = ["000000000000", "a1b2c3d4e5f6", "a1b2c3d4e5f7", "not-hex", "s"]
    numbers = [offsets.incarnation_of(i) for i in ids]
    assert all(0 < n < 10**16 for n in numbers) and len(set(numbers)) == len(ids)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "abc",
        "-2",
        "0000000000000000",
        "000000000000001_0000000000000005",
        "9999999999999999_99999999999999999",
        "0000000000000000_000000000000000a",
        "0000000000000000_00000000000000001",
        "1,2",
        "../0",
    ],
)
def test_malformed_offsets_are_400(bad: str) -> None:
    assert status_of(offsets.parse_query_offset, [bad]) == 400


def test_offset_given_twice_is_400() -> None:
    assert status_of(offsets.parse_query_offset, ["-1", "-1"]) == 400


def test_offset_sentinels() -> None:
    assert offsets.parse_query_offset([]) is None
    assert offsets.parse_query_offset(["-1"]) == "-1"
    assert offsets.parse_query_offset(["now"]) == "now"


# ---- names ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        "/v1/stream/a/../b",
        "/v1/stream/..",
        "/v1/stream/a//b",
        "/v1/stream/a%00b",
        "/v1/stream/%2e%2e",
        "/v1/stream/a%2F..%2Fb",
        "/v1/stream/%FF",
        "/v1/stream/a\\b",
        "/v1/stream/%",
        "/v1/stream/a%zz",
        "/v1/stream/",
        "/v1/stream/" + "x" * 300,
    ],
)
def test_names_that_could_escape_or_confuse_are_rejected(raw: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_stream_name(raw)
    assert caught.value.status == 400


def test_reserved_prefix_is_404() -> None:
    with pytest.raises(ProtocolError) as caught:
        check_stream_name("__ds/subscriptions/x")
    assert caught.value.status == 404


def test_hierarchical_and_unicode_names_are_allowed() -> None:
    assert parse_stream_name("/v1/stream/chat/room-1") == "chat/room-1"
    assert parse_stream_name("/v1/stream/caf%C3%A9") == "café"


# ---- headers -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["+3600", "03600", "3600.0", "3.6e3", "-1", "", " 1", "abc"])
def test_invalid_ttl_is_400(value: str) -> None:
    assert status_of(headers.ttl_seconds, Headers([("Stream-TTL", value)])) == 400


def test_ttl_and_expiry_together_is_400() -> None:
    both = Headers([("Stream-TTL", "10"), ("Stream-Expires-At", "2030-01-01T00:00:00Z")])
    assert status_of(CreateSpec.from_request, both, b"") == 400


@pytest.mark.parametrize("value", ["tomorrow", "2030-01-01", "2030-01-01T00:00:00", "2030-13-01T00:00:00Z"])
def test_invalid_expires_at_is_400(value: str) -> None:
    assert status_of(headers.expires_at, Headers([("Stream-Expires-At", value)])) == 400


def test_closed_flag_only_for_true() -> None:
    assert headers.closed_flag(Headers([("Stream-Closed", "TRUE")]))
    for value in ("false", "yes", "1", ""):
        assert not headers.closed_flag(Headers([("Stream-Closed", value)]))


@pytest.mark.parametrize(
    "given",
    [
        [("Producer-Id", "p")],
        [("Producer-Id", "p"), ("Producer-Epoch", "0")],
        [("Producer-Id", ""), ("Producer-Epoch", "0"), ("Producer-Seq", "0")],
        [("Producer-Id", "p"), ("Producer-Epoch", "-1"), ("Producer-Seq", "0")],
        [("Producer-Id", "p"), ("Producer-Epoch", "0"), ("Producer-Seq", "1.5")],
        [("Producer-Id", "p"), ("Producer-Epoch", str(2**53)), ("Producer-Seq", "0")],
    ],
)
def test_bad_producer_headers_are_400(given: list[tuple[str, str]]) -> None:
    assert status_of(headers.producer, Headers(given)) == 400


# ---- JSON mode -----------------------------------------------------------------------------


def test_json_flattens_one_level() -> None:
    assert jsonmode.split_messages(b'[{"a":1},{"b":2}]', allow_empty_array=False) == [b'{"a":1}', b'{"b":2}']
    assert jsonmode.split_messages(b"[[[1,2,3]]]", allow_empty_array=False) == [b"[[1,2,3]]"]
    assert jsonmode.split_messages(b'"x"', allow_empty_array=False) == [b'"x"']


@pytest.mark.parametrize("body", [b"{", b"NaN", b"[1,]", b"\xff", b"[]", b"[1e400]", b'{"v": -1e999}'])
def test_invalid_json_and_empty_arrays_are_400(body: bytes) -> None:
    with pytest.raises(ProtocolError) as caught:
        jsonmode.split_messages(body, allow_empty_array=False)
    assert caught.value.status == 400


def test_a_lone_surrogate_escape_is_stored_escaped_and_reads_back_the_same() -> None:
    """JSON by its grammar, with no UTF-8 form: stored with its non-ASCII escaped, not a failed
    encode (a 500); a snapshot of such a value (compaction) is encoded the same way."""
    body = '[{"s": "x\\ud800y", "t": "é"}]'.encode()
    stored = jsonmode.split_messages(body, allow_empty_array=False)
    assert stored == [b'{"s":"x\\ud800y","t":"\\u00e9"}']
    assert json.loads(stored[0]) == json.loads(body)[0]
    fold = StateFold()
    fold.apply(b'{"type": "t", "key": "k", "value": "\\udc00", "headers": {"operation": "insert"}}')
    assert json.loads(fold.snapshot("x")[1])["value"] == "\udc00"


def test_empty_array_creates_empty_json_stream() -> None:
    assert jsonmode.split_messages(b"[]", allow_empty_array=True) == []


# ---- cursors -------------------------------------------------------------------------------


def test_cursor_never_goes_back() -> None:
    now = cursor.EPOCH + 20 * 1000 + 5
    assert cursor.response_cursor(None, now) == "1000"
    assert cursor.response_cursor("999", now) == "1000"
    for _ in range(50):
        advanced = int(cursor.response_cursor("1000", now))
        assert 1000 < advanced <= 1000 + 180
    assert cursor.response_cursor("garbage", now) == "1000"


# ---- appends and producers -----------------------------------------------------------------


def test_plain_append_plans_and_applies() -> None:
    s = state()
    plan = plan_append(s, append_spec(b"hello"))
    assert isinstance(plan, AppendPlan) and plan.messages == [b"hello"]
    outcome = apply_append(s, plan, 5)
    assert (outcome.status, outcome.next_offset, s.tail) == (204, 5, 5)


def test_append_precedence_closed_before_content_type() -> None:
    s = state(closed=True)
    with pytest.raises(ProtocolError) as caught:
        plan_append(s, append_spec(content_type="application/json"))
    assert caught.value.status == 409
    assert ("Stream-Closed", "true") in caught.value.headers


def test_content_type_compared_by_media_type() -> None:
    assert isinstance(plan_append(state(), append_spec(content_type="Text/Plain; charset=utf-8")), AppendPlan)
    assert status_of(plan_append, state(), append_spec(content_type="application/json")) == 409


def test_stream_seq_must_increase_bytewise() -> None:
    s = state(last_stream_seq="b")
    assert status_of(plan_append, s, append_spec(stream_seq="a")) == 409
    assert status_of(plan_append, s, append_spec(stream_seq="b")) == 409
    assert isinstance(plan_append(s, append_spec(stream_seq="c")), AppendPlan)


def test_producer_matrix() -> None:
    s = state()
    s.producers["p"] = ProducerState(epoch=2, last_seq=5)
    assert plan_append(s, append_spec(producer=producer(epoch=2, seq=6))).producer_state == ProducerState(
        2, 6
    )
    duplicate = plan_append(s, append_spec(producer=producer(epoch=2, seq=5)))
    assert isinstance(duplicate, AppendOutcome) and duplicate.status == 204 and duplicate.producer_seq == 5
    assert status_of(plan_append, s, append_spec(producer=producer(epoch=1, seq=0))) == 403
    assert status_of(plan_append, s, append_spec(producer=producer(epoch=2, seq=8))) == 409
    assert status_of(plan_append, s, append_spec(producer=producer(epoch=3, seq=1))) == 400
    assert plan_append(s, append_spec(producer=producer(epoch=3, seq=0))).producer_state == ProducerState(
        3, 0
    )
    assert status_of(plan_append, s, append_spec(producer=producer(pid="new", seq=4))) == 409


def test_close_by_producer_then_its_retry_is_a_duplicate() -> None:
    s = state()
    plan = plan_append(s, append_spec(b"last", close=True, producer=producer(seq=0)))
    assert isinstance(plan, AppendPlan)
    outcome = apply_append(s, plan, 4)
    assert outcome.status == 200 and outcome.closed
    assert s.meta.closed_by == ProducerMark("p", 0, 0)
    retry = plan_append(s, append_spec(b"last", close=True, producer=producer(seq=0)))
    assert isinstance(retry, AppendOutcome) and retry.status == 204 and retry.closed
    assert status_of(plan_append, s, append_spec(b"more", producer=producer(seq=1))) == 409


def test_close_only_is_idempotent() -> None:
    s = state(closed=True)
    outcome = plan_append(s, append_spec(b"", close=True))
    assert isinstance(outcome, AppendOutcome) and outcome.status == 204 and outcome.closed


def test_create_matching_compares_config_and_closure() -> None:
    spec = CreateSpec.from_request(Headers([("Content-Type", "text/plain"), ("Stream-TTL", "60")]), b"")
    meta = spec.new_meta("s", "id", 0.0)
    assert spec.matches(meta)
    assert not CreateSpec.from_request(Headers([("Content-Type", "text/plain")]), b"").matches(meta)
    meta.closed = True
    assert not spec.matches(meta)


def test_sliding_ttl_and_absolute_expiry() -> None:
    meta = StreamMeta("s", "id", "text/plain", created_at=0.0, ttl_seconds=10, last_access=100.0)
    assert not meta.expired(109.9) and meta.expired(110.0)
    absolute = StreamMeta("s", "id", "text/plain", created_at=0.0, expires_at_ts=50.0)
    assert not absolute.expired(49.0) and absolute.expired(50.0)


# ---- SSE framing ---------------------------------------------------------------------------


def test_sse_splits_lines_and_encodes_binary() -> None:
    assert sse.event("data", "a\nb\r\nc") == b"event: data\ndata:a\ndata:b\ndata:c\n\n"
    assert sse.data_payload([b"\x00\xff"], json_mode=False, base64_mode=True) == "AP8="
    assert sse.data_payload([b"1", b"[2]"], json_mode=True, base64_mode=False) == "[1,[2]]"
    closed = sse.control("00", cursor="5", up_to_date=False, closed=True)
    assert b'"streamClosed":true' in closed and b"streamCursor" not in closed


def test_copy_meta_copies_every_field() -> None:
    """copy_meta is written out from the field list (protocol/stream.py): a field it missed would
    be lost on every append's planned state."""
    values = {}
    for number, item in enumerate(fields(StreamMeta)):
        values[item.name] = (number, item.name)  # a distinct value per field, whatever its type
    meta = StreamMeta(**values)  # type: ignore[arg-type]
    copy = copy_meta(meta)
    assert copy is not meta
    assert all(getattr(copy, name) == value for name, value in values.items())
