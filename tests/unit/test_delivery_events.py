"""Delivery events' parts on their own: the event and its key, the trace log's cursor,
the writer thread (rotation, a file that cannot be written, a full queue).

Real files in a temporary directory; no Postfix (tests/test_delivery_events_real.py
runs the whole on real Postfix).
"""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest

from pyqmgr.events import writer as writer_mod
from pyqmgr.events.record import SCHEMA, Context, decode, encode, event_key, make_event
from pyqmgr.events.tracker import DeliveryEvents, NoEvents
from pyqmgr.events.writer import EventWriter, Paced
from pyqmgr.postfix.bounce_log import LogEntry
from pyqmgr.postfix.deliver_request import DEL_REQ_FLAG_RECORD
from pyqmgr.postfix.trace_log import TraceCursor, read_more, relay_and_reply


def record(rcpt: str, offset: int, status: str = "2.0.0", action: str = "relayed",
           reason: str = "delivery via mx.example[192.0.2.1]:25: 250 2.0.0 Ok") -> bytes:
    """One record as bounce_append_service writes it (old-style line first)."""
    return (f"\n<{rcpt}>: {reason}\nrecipient={rcpt}\noffset={offset}\nstatus={status}\n"
            f"action={action}\nmta_type=dns\nmta_mname=mx.example\nreason={reason}\n\n"
            ).encode()


CTX = Context("4F2A31C0E1", "s@example.org", 1795978859.210185, "smtp", "example.com",
              "google", "bulk", "t1")


# -- the event -----------------------------------------------------------------------------


def test_an_event_carries_every_field_and_a_stable_key():
    entry = LogEntry(recipient="a@example.com", offset=649, status="2.0.0", action="relayed",
                     mta_mname="mx.example",
                     reason="delivery via mx.example[192.0.2.1]:25: 250 2.0.0 Ok: queued")
    ev = make_event(CTX, entry, 1, 1795978860.5, "delivered")
    assert ev == {
        "v": SCHEMA, "key": "4F2A31C0E1.6616ee9ed65c9.649.1", "queue_id": "4F2A31C0E1",
        "recipient": "a@example.com", "original_recipient": "a@example.com",
        "sender": "s@example.org", "transport": "smtp", "source": "smtp",
        "nexthop": "example.com", "relay": "mx.example[192.0.2.1]:25",
        "remote_mta": "mx.example", "site": "google", "class": "bulk", "tenant": "t1",
        "status": "sent", "dsn": "2.0.0", "action": "relayed",
        "reply": "250 2.0.0 Ok: queued", "diagnostic": "", "category": "delivered",
        "attempt": 1, "arrival": 1795978859.210185, "time": 1795978860.5}
    line = encode(ev)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode(line) == ev
    # Read again (another process, another clock): the same key.
    assert make_event(CTX, entry, 1, 1.0)["key"] == ev["key"]


def test_the_key_tells_attempts_recipients_and_reused_queue_ids_apart():
    entry = LogEntry(recipient="a@example.com", offset=649)
    keys = {event_key(CTX, entry, 1), event_key(CTX, entry, 2),
            event_key(CTX, LogEntry(recipient="b@example.com", offset=700), 1),
            event_key(Context(CTX.queue_id, "", CTX.arrival + 1e-6), entry, 1)}
    assert len(keys) == 4
    # No offset (a corrupt record): the address stands in, the same each time.
    bare = LogEntry(recipient="c@example.com")
    assert event_key(CTX, bare, 1) == event_key(CTX, LogEntry(recipient="c@example.com"), 1)
    assert event_key(CTX, bare, 1) != event_key(CTX, LogEntry(recipient="d@example.com"), 1)


@pytest.mark.parametrize("action, status", [("delivered", "sent"), ("relayed", "sent"),
                                            ("expanded", "sent"), ("delayed", "deferred"),
                                            ("failed", "bounced")])
def test_the_status_is_the_maillogs_word(action, status):
    assert make_event(CTX, LogEntry(action=action), 1, 0.0)["status"] == status


def test_relay_and_reply():
    assert relay_and_reply("delivery via local: delivered to mailbox") == (
        "local", "delivered to mailbox")
    assert relay_and_reply("delivery via a[1.2.3.4]:25: 450 4.2.0 x: y") == (
        "a[1.2.3.4]:25", "450 4.2.0 x: y")
    assert relay_and_reply("mail transport unavailable") == ("", "mail transport unavailable")


def test_odd_text_is_encoded_not_refused():
    ev = make_event(CTX, LogEntry(recipient="ü\u2028@example.com", reason='"\\\x01'), 1, 0.0)
    assert decode(encode(ev))["recipient"] == "ü\u2028@example.com"


# -- the trace log -------------------------------------------------------------------------


def test_the_cursor_takes_whole_records_and_waits_for_one_being_written(tmp_path):
    path = str(tmp_path / "ID")
    with open(path, "wb") as f:
        f.write(record("a@x", 100) + record("b@x", 200, "4.2.0", "delayed"))
    cursor = TraceCursor()
    piece = read_more(path, cursor)
    assert [(e.recipient, e.offset, e.action) for e in piece.entries] == [
        ("a@x", 100, "relayed"), ("b@x", 200, "delayed")]
    assert cursor.offset == os.path.getsize(path)
    half = record("c@x", 300)
    with open(path, "ab") as f:
        f.write(half[:40])
    assert read_more(path, cursor).entries == []
    with open(path, "ab") as f:
        f.write(half[40:])
    assert [e.recipient for e in read_more(path, cursor).entries] == ["c@x"]
    assert read_more(str(tmp_path / "none"), TraceCursor()).entries == []


def test_a_corrupt_record_is_a_warning_and_the_rest_is_read(tmp_path):
    path = str(tmp_path / "ID")
    with open(path, "wb") as f:
        f.write(record("a@x", 100) + b"\n\x00\xff garbage\nno equals sign\n\n"
                + record("b@x", 200))
    piece = read_more(path, TraceCursor())
    assert "a@x" in [e.recipient for e in piece.entries]
    assert "b@x" in [e.recipient for e in piece.entries]
    assert piece.warnings and "malformed record" in piece.warnings[0]


def test_a_huge_record_is_skipped_with_a_warning(tmp_path):
    path = str(tmp_path / "ID")
    huge = b"\nrecipient=h@x\nreason=" + b"x" * 50_000 + b"\n\n"
    with open(path, "wb") as f:
        f.write(record("a@x", 100) + huge + record("b@x", 200))
    cursor = TraceCursor()
    piece = read_more(path, cursor, window=4096)
    assert [e.recipient for e in piece.entries] == ["a@x", "b@x"]
    assert piece.skipped == 1 and "larger than" in piece.warnings[0]
    assert cursor.offset == os.path.getsize(path) and not cursor.skipping


def test_a_name_that_is_no_file_is_an_error(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError):
        read_more(str(tmp_path / "fifo"), TraceCursor())
    os.symlink(tmp_path / "fifo", tmp_path / "link")
    with pytest.raises(OSError):
        read_more(str(tmp_path / "link"), TraceCursor())


# -- the writer ----------------------------------------------------------------------------


def _writer(tmp_path, warnings, **kw) -> EventWriter:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    kw.setdefault("size_limit", 1 << 20)
    kw.setdefault("keep", 2)
    return EventWriter(fd, "events.jsonl", kw.pop("size_limit"), kw.pop("keep"),
                       warnings.append, None, **kw)


def _wait(predicate, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_batches_are_written_then_their_callbacks_run(tmp_path):
    warnings: list[str] = []
    w = _writer(tmp_path, warnings)
    done = threading.Event()
    w.start()
    assert w.submit([b'{"key":"1"}\n', b'{"key":"2"}\n'], done.set)
    assert done.wait(5)
    w.stop()
    assert (tmp_path / "events.jsonl").read_bytes() == b'{"key":"1"}\n{"key":"2"}\n'
    assert (w.stats.written, w.stats.queued, warnings) == (2, 0, [])
    assert w.stats.fsyncs >= 1


def test_the_file_rotates_by_size_and_keeps_so_many(tmp_path):
    w = _writer(tmp_path, [], size_limit=4096, keep=2)
    w.start()
    line = b'{"key":"' + b"k" * 1000 + b'"}\n'
    for _ in range(20):
        done = threading.Event()
        w.submit([line], done.set)
        assert done.wait(5)
    w.stop()
    names = sorted(os.listdir(tmp_path))
    assert names == ["events.jsonl", "events.jsonl.1", "events.jsonl.2"]
    assert all(os.path.getsize(tmp_path / n) <= 4096 for n in names)
    assert w.stats.rotations >= 4


def test_a_file_that_cannot_be_written_keeps_events_waiting_then_writes_them(
        tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod, "RETRY_DELAY", 0.05)
    warnings: list[str] = []
    # A directory where the file should be: the open fails as a full disk's would.
    os.mkdir(tmp_path / "events.jsonl")
    w = _writer(tmp_path, warnings, max_queued=3)
    done = threading.Event()
    w.start()
    assert w.submit([b'{"key":"1"}\n', b'{"key":"2"}\n'], done.set)
    assert not w.submit([b'{"key":"3"}\n', b'{"key":"4"}\n'])  # past the bound: held back
    _wait(lambda: w.stats.failures >= 3, "three failed tries")
    assert not done.is_set(), "the trace logs must stay while nothing was written"
    assert len(warnings) == 1, "one warning, not one a try"
    assert "events wait in memory" in warnings[0] and "trace logs are kept" in warnings[0]
    assert w.stats.held_back == 2
    os.rmdir(tmp_path / "events.jsonl")
    assert done.wait(5)
    w.stop()
    assert (tmp_path / "events.jsonl").read_bytes() == b'{"key":"1"}\n{"key":"2"}\n'


def test_recent_finds_a_messages_last_event(tmp_path):
    w = _writer(tmp_path, [])
    lines = [encode(make_event(CTX, LogEntry(recipient="a@x", offset=9), n, 0.0))
             for n in (1, 2)]
    (tmp_path / "events.jsonl").write_bytes(b"".join(lines) + b"not json\n")
    found = w.recent({CTX.queue_id, "NOTHERE"})
    assert set(found) == {CTX.queue_id}
    last = found[CTX.queue_id][""]
    assert last["attempt"] == 2 and last["arrival"] == CTX.arrival
    assert found[CTX.queue_id]["a@x"] is last


# -- the reader in the daemon --------------------------------------------------------------


def _message(qid: str, tflags: int = 0, rflags: int = 0) -> SimpleNamespace:
    qf = SimpleNamespace(rflags=rflags, sender="s@example.org", arrival_time=(1795978859, 210185))
    return SimpleNamespace(queue_id=qid, tflags=tflags, qf=qf,
                           sched=SimpleNamespace(rank=0, tenant=""))


def _entry(am: SimpleNamespace) -> SimpleNamespace:
    queue = SimpleNamespace(transport=SimpleNamespace(name="smtp"), nexthop="example.com",
                            site=None)
    return SimpleNamespace(message=SimpleNamespace(owner=am), queue=queue)


@pytest.fixture
def queue_dir(tmp_path, monkeypatch):
    """A queue directory of the files the reader looks at, as the daemon's cwd."""
    for name in ("trace", "active", "deferred", "incoming", "hold", "events"):
        os.mkdir(tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _events(queue_dir, max_queued: int = 1000) -> tuple[DeliveryEvents, EventWriter]:
    fd = os.open(queue_dir / "events", os.O_RDONLY | os.O_DIRECTORY)
    writer = EventWriter(fd, "e.jsonl", 1 << 20, 1, lambda text: None, None,
                         max_queued=max_queued)
    return DeliveryEvents(writer, "", 1, lambda text: None, lambda text: None), writer


def _lines(queue_dir) -> list[dict[str, object]]:
    path = queue_dir / "events" / "e.jsonl"
    return [json.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []


def test_a_deferred_messages_log_stays_and_a_gone_ones_goes_once_written(queue_dir):
    events, writer = _events(queue_dir)
    writer.start()
    am = _message("ABC123")
    assert events.flags(_entry(am)) == DEL_REQ_FLAG_RECORD
    (queue_dir / "trace" / "ABC123").write_bytes(
        record("a@x", 100) + record("b@x", 200, "4.2.0", "delayed"))
    events.after_reply(am, _entry(am))
    (queue_dir / "deferred" / "ABC123").write_bytes(b"")  # the pass ends deferred
    events.message_left(am)
    _wait(lambda: len(_lines(queue_dir)) == 2, "two events")
    time.sleep(0.2)
    assert (queue_dir / "trace" / "ABC123").exists(), "deferred: its log stays"
    # The next pass: b@x's second attempt is its attempt 2; then the message goes.
    os.unlink(queue_dir / "deferred" / "ABC123")
    with open(queue_dir / "trace" / "ABC123", "ab") as f:
        f.write(record("b@x", 200))
    events.flags(_entry(am))
    events.after_reply(am, _entry(am))
    events.message_left(am)
    _wait(lambda: not (queue_dir / "trace" / "ABC123").exists(), "the log's removal")
    writer.stop()
    got = [(e["recipient"], e["status"], e["attempt"]) for e in _lines(queue_dir)]
    assert got == [("a@x", "sent", 1), ("b@x", "deferred", 1), ("b@x", "sent", 2)]
    assert events.stats.logs_removed == 1 and not events.logs


def test_events_not_queued_keep_the_log_and_a_restart_writes_them_with_their_keys(queue_dir):
    events, writer = _events(queue_dir, max_queued=1)
    am = _message("DEF456")
    events.flags(_entry(am))
    (queue_dir / "trace" / "DEF456").write_bytes(record("a@x", 100) + record("b@x", 200))
    events.after_reply(am, _entry(am))  # two events, room for one: held back
    events.message_left(am)
    assert writer.stats.held_back == 2
    writer.start()
    writer.stop()
    assert (queue_dir / "trace" / "DEF456").exists() and _lines(queue_dir) == []
    # A new qmgr: the message is in no queue; its log is read whole, then removed.
    again, writer2 = _events(queue_dir)
    writer2.start()
    assert again.leftovers() == 1
    _wait(lambda: not (queue_dir / "trace" / "DEF456").exists(), "the log's removal")
    writer2.stop()
    assert [e["recipient"] for e in _lines(queue_dir)] == ["a@x", "b@x"]


def test_a_leftover_log_repeats_the_keys_its_events_had(queue_dir):
    events, writer = _events(queue_dir)
    writer.start()
    am = _message("GHI789")
    events.flags(_entry(am))
    (queue_dir / "trace" / "GHI789").write_bytes(record("a@x", 100))
    events.after_reply(am, _entry(am))
    _wait(lambda: len(_lines(queue_dir)) == 1, "the event")
    writer.stop()
    # Killed before the log went: the next qmgr finds it, the message gone.
    again, writer2 = _events(queue_dir)
    writer2.start()
    assert again.leftovers() == 1
    _wait(lambda: len(_lines(queue_dir)) == 2, "the repeat")
    writer2.stop()
    first, repeat = _lines(queue_dir)
    assert first["key"] == repeat["key"] and repeat["sender"] == "s@example.org"
    assert again.stats.repeated == 1


def test_a_leftover_logs_recipients_keep_their_own_requests_transport(queue_dir):
    """A message to two destinations, killed before its log went: at start-up each
    recipient's repeat carries its own request's transport and next hop, read off its
    own last event, and a recipient with none written the message's last one's."""
    events, writer = _events(queue_dir)
    writer.start()
    am = _message("JKL012")
    one, two = _entry(am), _entry(am)
    two.queue = SimpleNamespace(transport=SimpleNamespace(name="relay"),
                                nexthop="other.example", site=None)
    events.flags(one)
    (queue_dir / "trace" / "JKL012").write_bytes(record("a@x", 100))
    events.after_reply(am, one)
    events.flags(two)
    with open(queue_dir / "trace" / "JKL012", "ab") as f:
        f.write(record("b@y", 200))
    events.after_reply(am, two)
    _wait(lambda: len(_lines(queue_dir)) == 2, "two events")
    writer.stop()
    with open(queue_dir / "trace" / "JKL012", "ab") as f:
        f.write(record("c@y", 300))  # written, its event not, when qmgr was killed
    again, writer2 = _events(queue_dir)
    writer2.start()
    assert again.leftovers() == 1
    _wait(lambda: len(_lines(queue_dir)) == 5, "the repeats and the new one")
    writer2.stop()
    got = [(e["recipient"], e["transport"], e["nexthop"]) for e in _lines(queue_dir)[2:]]
    assert got == [("a@x", "smtp", "example.com"), ("b@y", "relay", "other.example"),
                   ("c@y", "relay", "other.example")]


def test_a_message_that_asked_for_a_trace_gets_no_flag(queue_dir):
    events, _writer = _events(queue_dir)
    assert events.flags(_entry(_message("A1", tflags=DEL_REQ_FLAG_RECORD))) == 0
    assert events.flags(_entry(_message("A2", rflags=1 << 2))) == 0  # NOTIFY=SUCCESS
    assert events.flags(_entry(_message("A3", tflags=1 << 8))) == 0  # an address probe
    assert NoEvents().flags(_entry(_message("A4"))) == 0


def test_paced_warnings_count_what_they_kept_quiet():
    said: list[str] = []
    warn = Paced(said.append, every=0.2)
    for _ in range(5):
        warn("disk full")
    time.sleep(0.25)
    warn("disk full")
    assert said == ["disk full", "disk full (4 more since the last such warning)"]


def test_an_event_line_is_one_json_object():
    with pytest.raises(ValueError):
        decode(b"[1, 2]")
    assert json.loads(encode({"key": "k"})) == {"key": "k"}


# -- the fast roads equal the general ones ---------------------------------------------------


ODD_LOGS = [
    record("a@x", 100) + record("b@x", 200, "4.2.0", "delayed"),
    # Every name the bounce daemon writes, values with blanks around them.
    b"\nrecipient=a@x\noriginal_recipient=A@x\noffset=17\ndsn_orig_rcpt=rfc822;a@x\n"
    b"notify_flags=6\nstatus=5.1.1\naction=failed\ndiag_type=smtp\ndiag_text=550 no\n"
    b"mta_type=dns\nmta_mname=mx\nreason=  delivery via mx[1.2.3.4]:25: 550 no  \n\n",
    # Missing fields: stock's place holders; empty addresses: MAILER-DAEMON.
    b"\nrecipient=\noriginal_recipient=\noffset=0\nnotify_flags=99\n\n\n\n<>: x\n\n",
    # An entry no blank line ends is left out.
    record("a@x", 100) + b"recipient=c@x\n\n"[:-1],
    # What the fast road hands to the parser: odd offsets, unknown names, bad lines,
    # bytes that are not printable ASCII.
    b"\nrecipient=a@x\noffset= 12abc\n\n",
    b"\nrecipient=a@x\noffset=-3\n\n",
    b"\nrecipient=a@x\nflavour=vanilla\n\n",
    b"\nrecipient =a@x\n\n",
    b"\nno equals sign\n\n",
    b"\n<a@x> no colon\n\n",
    b"\nrecipient=a\tb@x\nreason=caf\xc3\xa9 \xff\n\n",
    b"\nrecipient=a@x\n reason=x\n\n",
]


@pytest.mark.parametrize("data", ODD_LOGS)
def test_the_trace_records_fast_parser_equals_stocks_state_machine(data):
    from pyqmgr.postfix.bounce_log import parse
    from pyqmgr.postfix.trace_log import parse_records

    full = parse(data, "trace/ID", "trace")
    fast = parse_records(data)
    if fast is None:
        return  # handed to the parser: read_more then gives ``full``, with its warnings
    assert fast == full.entries and not full.warnings


def test_the_fast_parser_takes_what_the_bounce_daemon_writes():
    from pyqmgr.postfix.trace_log import parse_records

    assert all(parse_records(data) is not None for data in ODD_LOGS[:4])
    assert all(parse_records(data) is None for data in ODD_LOGS[4:])


@pytest.mark.parametrize("ctx", [
    CTX, Context("B1", "", 0.0), Context("C2", 'q"\\\x01ü\u2028@x', 1.5e9 + 1e-6, "t", "n")])
@pytest.mark.parametrize("entry", [
    LogEntry(recipient="a@example.com", offset=649, status="2.0.0", action="relayed",
             mta_mname="mx.example", diag_text="250 ok",
             reason="delivery via mx.example[192.0.2.1]:25: 250 2.0.0 Ok: queued"),
    LogEntry(recipient="ü\u2028@example.com", original_recipient='"odd"@x',
             reason='"\\\x01\udcff', action="weird"),
    LogEntry(),
])
def test_the_pre_encoded_line_equals_the_events_json(ctx, entry):
    from pyqmgr.events.record import EventLine

    for ordinal, ended, category in ((1, 1795978860.5, "delivered"), (12, 0.0, "")):
        assert EventLine(ctx).line(entry, ordinal, ended, category) == encode(
            make_event(ctx, entry, ordinal, ended, category))


def test_a_message_that_arrived_after_the_start_is_not_counted_as_repeated(queue_dir):
    events, writer = _events(queue_dir)
    old, new = _message("OLD1"), _message("NEW1")
    new.qf.arrival_time = (int(events.started) + 5, 0)
    for am in (old, new):
        # A log before this process's first request: an earlier qmgr's records.
        (queue_dir / "trace" / am.queue_id).write_bytes(record("a@x", 100))
        events.flags(_entry(am))
        events.after_reply(am, _entry(am))
    # Both are read whole; only the one that arrived before the start was looked for.
    assert events.stats.events == 2 and events.stats.repeated == 1


def test_a_device_that_reads_without_end_is_refused():
    # /dev/zero gives bytes for ever: read as a log it would be skipped a window at a time.
    with pytest.raises(OSError, match="not a regular file"):
        read_more("/dev/zero", TraceCursor())
    assert read_more("/dev/null", TraceCursor()).entries == []
