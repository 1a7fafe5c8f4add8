"""pyqmgr status and explain as text, from canned replies: the columns an admin reads
(window/limit, in flight, queued, dead with why and until when) and every sort order."""

from __future__ import annotations

import time

import pytest

from pyqmgr.control.render import explain_lines, status_lines

REPLY: dict[str, object] = {
    "ok": True, "messages": 3, "recipients": 7,
    "transports": [{"name": "smtp", "policy": "nqmgr", "agents_busy": 5,
                    "agents_pending": 1, "process_limit": 100, "destinations": 2,
                    "queued_entries": 4, "queued_recipients": 6, "dead": False}],
    "destinations": [
        {"transport": "smtp", "name": "a.example", "window": 5, "limit": 20,
         "in_flight": 5, "queued_entries": 1, "queued_recipients": 1, "success": 0.0,
         "failure": 0.0, "fail_cohorts": 0.0, "dead": False},
        {"transport": "smtp", "name": "b.example", "window": 0, "limit": 20,
         "in_flight": 0, "queued_entries": 3, "queued_recipients": 5, "success": 0.0,
         "failure": 1.0, "fail_cohorts": 1.0, "dead": True,
         "reason": "connect refused", "retry_in": 299.5},
    ],
}


def test_status_tables():
    lines = status_lines(REPLY)
    assert lines[0] == "active queue: 3 messages, 7 recipients in core"
    assert lines[2].split() == ["TRANSPORT", "POLICY", "BUSY/LIMIT", "PENDING", "DESTS",
                                "QUEUED", "RCPTS", "STATE"]
    assert lines[3].split() == ["smtp", "nqmgr", "5/100", "1", "2", "4", "6"]
    rows = [ln for ln in lines if ln.startswith(("a.example", "b.example"))]
    assert rows[0].split() == ["a.example", "smtp", "5/20", "5", "1", "1", "0", "0", "0"]
    # 299.5 s in human units (issue #43: "in 597.943s" is read as 9m58s).
    assert rows[1].endswith("dead: connect refused (retry in 5m)")


def test_sort_orders():
    def order(sort: str) -> list[str]:
        return [ln.split()[0] for ln in status_lines(REPLY, sort)
                if ln.startswith(("a.example", "b.example"))]

    assert order("name") == ["a.example", "b.example"]
    assert order("busy") == ["a.example", "b.example"]
    assert order("window") == ["a.example", "b.example"]
    assert order("queued") == ["b.example", "a.example"]


def test_status_without_destinations():
    assert status_lines({"ok": True, "transports": [], "destinations": []})[-1] == (
        "no destinations in core")


def test_explain_lines():
    reply = {"ok": True, "target": "a.example", "kind": "destination",
             "destinations": [REPLY["destinations"][0]],  # type: ignore[index]
             "reasons": [{"constraint": "window full",
                          "setting": "smtp_destination_concurrency_limit",
                          "text": "a.example has 5 deliveries in flight"}]}
    assert explain_lines(reply) == [
        "a.example: destination (smtp: window 5/20, 5 in flight, 1 queued)",
        "  window full: a.example has 5 deliveries in flight",
        "      setting: smtp_destination_concurrency_limit"]
    unknown = {"ok": True, "target": "X1", "kind": "unknown",
               "reasons": [{"constraint": "not found", "setting": "",
                            "text": "X1 is not in core"}]}
    assert explain_lines(unknown) == ["X1: not in core, nor in the queue",
                                      "  not found: X1 is not in core"]


def test_shaping_gates_and_caps_show_in_the_state_column():
    from pyqmgr.control.render import status_lines

    reply = {"messages": 1, "recipients": 2, "transports": [], "destinations": [
        {"name": "a.example", "transport": "smtp", "window": 5, "limit": 20, "in_flight": 5,
         "gate": {"kind": "rate", "setting": "smtp_destination_rate", "opens_in": 0.25},
         "cap": 5},
        {"name": "b.example", "transport": "smtp", "window": 3, "limit": 20, "in_flight": 0,
         "gate": {"kind": "policy service", "opens_in": 58.0}}]}
    text = "\n".join(status_lines(reply))
    assert "rate (opens in 250ms), window capped at 5 (throttling)" in text
    assert "policy service (opens in 58s)" in text


@pytest.fixture
def utc(monkeypatch):
    """Local time is UTC for the test (the clock times printed), and back after."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_explain_of_a_deferred_message_outside_core(utc):
    """Issue #43: where it is, its times in human units, each recipient's last reason,
    and its destination's state in core."""
    reply = {
        "ok": True, "target": "4F2A1C0D3E", "kind": "message", "queue": "deferred",
        "in_core": False, "sender": "s@test.example", "arrival_time": 1_700_000_000.25,
        "arrived_ago": 125.0, "next_try_time": 1_700_000_723.0, "next_try_in": 597.943,
        "expires_time": 1_700_432_000.0, "expires_in": 431_875.0,
        "lifetime_setting": "maximal_queue_lifetime", "recipients_pending": 60,
        "recipients_more": False,
        "recipients": [{"address": "a@dead.example", "status": "4.4.1", "action": "delayed",
                        "reason": "connect to x: Connection refused", "transport": "smtp",
                        "nexthop": "dead.example"},
                       {"address": "b@gone.example", "transport": "smtp",
                        "nexthop": "gone.example"}],
        "destinations": [{"transport": "smtp", "nexthop": "dead.example", "in_core": True},
                         {"transport": "smtp", "nexthop": "gone.example", "in_core": False}],
        "defer_log": {"path": "defer/4/4F2A1C0D3E", "entries": 1, "size": 3_000_000,
                      "read": 1_048_576},
        "reasons": [{"constraint": "deferred", "setting": "minimal_backoff_time",
                     "text": "in the deferred queue"},
                    {"constraint": "dead destination", "setting": "minimal_backoff_time",
                     "text": "dead.example is dead", "destination": "dead.example"}],
        "warnings": ["defer/4/4F2A1C0D3E: unknown attribute name: x, ignored"]}
    assert explain_lines(reply) == [
        "4F2A1C0D3E: message in the deferred queue (not in core)",
        "  from <s@test.example>, arrived 2023-11-14 22:13:20 (2m5s ago)",
        "  next try after 2023-11-14 22:25:23 (in 9m58s)",
        "  returned to the sender if not delivered by 2023-11-19 22:13:20 (in 5d, "
        "maximal_queue_lifetime)",
        "  deferred: in the deferred queue",
        "      setting: minimal_backoff_time",
        "  recipients: 60 to deliver, the first 2 shown",
        "    a@dead.example (smtp:dead.example): 4.4.1 connect to x: Connection refused",
        "    b@gone.example (smtp:gone.example): no reason logged",
        "  dead destination [dead.example]: dead.example is dead",
        "      setting: minimal_backoff_time",
        "  destination gone.example (smtp): not in core (no mail for it in the active "
        "queue now)",
        "  defer log defer/4/4F2A1C0D3E: the first 1048576 of 3000000 bytes read",
        "  warning: defer/4/4F2A1C0D3E: unknown attribute name: x, ignored"]
    held = {"target": "H1", "kind": "message", "queue": "hold", "in_core": False,
            "sender": "", "arrival_time": 1_700_000_000.0, "arrived_ago": 7300.0,
            "held_since": 1_700_003_600.0, "held_for": 3700.0, "reasons": []}
    assert explain_lines(held) == [
        "H1: message in the hold queue (not in core)",
        "  from <>, arrived 2023-11-14 22:13:20 (2h2m ago)",
        "  on hold since 2023-11-14 23:13:20 (1h2m ago)"]


def test_status_says_where_mx_lookups_run_and_how_they_went():
    """The sites' lookups (issue #44): answered, running, waiting, failures by cause,
    and the lookup helper, or that it is gone and qmgr looks up itself."""
    lookups = {"answered": 5, "lookups_running": 1, "lookups_waiting": 3,
               "failed": {"timeout": 2, "NXDOMAIN": 1},
               "helper": {"pid": 12, "ready": True, "answered": 5, "in_flight": 1}}
    text = "\n".join(status_lines({"site_lookups": lookups, "destinations": []}))
    assert ("MX lookups: 5 answered, 1 running, 3 waiting; NXDOMAIN 1, timeout 2; "
            "lookup helper pid 12: 1 in flight") in text
    lookups["helper"] = {"pid": 12, "gone": "killed", "lookups": "in qmgr"}
    lookups["failed"] = {}
    text = "\n".join(status_lines({"site_lookups": lookups, "destinations": []}))
    assert "none failed; lookup helper pid 12: gone (killed), lookups in qmgr" in text
