"""pyqmgr status and explain as text, from canned replies: the columns an admin reads
(window/limit, in flight, queued, dead with why and until when) and every sort order."""

from __future__ import annotations

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
    assert rows[1].endswith("dead: connect refused (retry in 299.5s)")


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
               "reasons": [{"constraint": "not in the active queue", "setting": "",
                            "text": "X1 is not in core"}]}
    assert explain_lines(unknown) == ["X1: not in core",
                                      "  not in the active queue: X1 is not in core"]


def test_shaping_gates_and_caps_show_in_the_state_column():
    from pyqmgr.control.render import status_lines

    reply = {"messages": 1, "recipients": 2, "transports": [], "destinations": [
        {"name": "a.example", "transport": "smtp", "window": 5, "limit": 20, "in_flight": 5,
         "gate": {"kind": "rate", "setting": "smtp_destination_rate", "opens_in": 0.25},
         "cap": 5},
        {"name": "b.example", "transport": "smtp", "window": 3, "limit": 20, "in_flight": 0,
         "gate": {"kind": "policy service", "opens_in": 58.0}}]}
    text = "\n".join(status_lines(reply))
    assert "rate (opens in 0.25s), window capped at 5 (throttling)" in text
    assert "policy service (opens in 58s)" in text
