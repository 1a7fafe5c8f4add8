"""``pyqmgr top``: ``pyqmgr status`` refreshed live in the terminal, with what changed.

Each refresh is one ``status`` request, the same bounded request ``pyqmgr status``
makes, so top costs the daemon what a status every ``--interval`` seconds costs
(1.5-1.7 ms of its event loop with 10,000 messages in core). What top adds is the
difference from the previous refresh: per destination the change in deliveries in
flight and in queued recipients, and the rows that changed in bold, so that mail
moving (or not) is visible without comparing numbers by eye.

The frames are built by pure functions (:func:`frame`) so that they can be tested
on canned replies; :func:`interactive` is the curses loop around them, and
:func:`batch` prints plain frames for scripts and pipes (curses needs a terminal on
both stdin and stdout; anything else gets the batch output, as ``top -b`` does):
a frame every interval until stopped (Ctrl-C, the reader of the pipe going away,
SIGTERM), or ``-n N`` of them, each written out whole as it is made, so that
``pyqmgr top | grep`` and ``pyqmgr top > file`` see each one at once.

The loop never gives up on the daemon: while it is not running (or refuses, or does
not answer) the screen says why and top asks again every interval, so it can be left
open across a ``postfix reload`` or restart.
"""

from __future__ import annotations

import curses
import os
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass

from pyqmgr.control.render import SORTS, _dicts, _fmt, _state, _table

#: ``s`` steps through the sort orders in this order (those of ``pyqmgr status``).
SORT_CYCLE = ("name", "window", "busy", "queued")

KEYS_HELP = "q quit, s sort, p pause, space refresh"


@dataclass
class Snapshot:
    """One answer of the daemon (``reply``) or why there is none (``error``)."""

    when: float
    reply: dict[str, object] | None = None
    error: str | None = None


#: What top asks with: returns the daemon's successful status reply, or raises
#: :class:`TopError` with the text to show.
Fetch = Callable[[], dict[str, object]]


class TopError(Exception):
    """No status this time; the text says why (shown, then asked again)."""

    def __init__(self, text: str, status: int) -> None:
        super().__init__(text)
        self.status = status


def _key(item: dict[str, object]) -> tuple[str, str]:
    return (str(item.get("transport", "")), str(item.get("name", "")))


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _delta(now: dict[str, object], before: dict[str, object] | None, name: str) -> str:
    """``+3`` / ``-2`` since the previous refresh; blank for no change or a new row."""
    if before is None:
        return ""
    change = _int(now.get(name)) - _int(before.get(name))
    return f"{change:+d}" if change else ""


def frame(current: dict[str, object], previous: dict[str, object] | None,
          sort: str) -> list[tuple[str, bool]]:
    """The lines of one refresh, each with whether it changed since ``previous``.

    Transports on top, destinations below, as ``pyqmgr status`` shows them, with the
    change in deliveries in flight (±) and queued recipients (±) beside the counts;
    destinations that appeared are marked ``new`` and those that left core counted.
    """
    before_t = {str(t.get("name")): t for t in _dicts(previous.get("transports"))} \
        if previous is not None else {}
    before_d = {_key(d): d for d in _dicts(previous.get("destinations"))} \
        if previous is not None else {}
    transports = _dicts(current.get("transports"))
    destinations = sorted(_dicts(current.get("destinations")), key=SORTS[sort])

    head = (f"active queue: {_fmt(current.get('messages'))} messages, "
            f"{_fmt(current.get('recipients'))} recipients in core")
    if previous is not None:
        head += (f" ({_delta(current, previous, 'messages') or '+0'} messages, "
                 f"{_delta(current, previous, 'recipients') or '+0'} recipients since "
                 "the last refresh)")
    out: list[tuple[str, bool]] = [(head, False), ("", False)]

    rows, changed = [], []
    for t in transports:
        old = before_t.get(str(t.get("name")))
        rows.append([_fmt(t.get("name")), _fmt(t.get("policy")),
                     f"{_fmt(t.get('agents_busy'))}/{_fmt(t.get('process_limit'))}",
                     _delta(t, old, "agents_busy"), _fmt(t.get("agents_pending")),
                     _fmt(t.get("destinations")), _fmt(t.get("queued_entries")),
                     _fmt(t.get("queued_recipients")), _delta(t, old, "queued_recipients"),
                     _state(t)])
        changed.append(old is not None and _moved(t, old))
    lines = _table(["TRANSPORT", "POLICY", "BUSY/LIMIT", "±", "PENDING", "DESTS", "QUEUED",
                    "RCPTS", "±", "STATE"], rows)
    out += [(lines[0], False)] + list(zip(lines[1:], changed, strict=True))
    out.append(("", False))
    out += _class_lines(current, previous)
    out += _site_lines(current, previous)
    out += _source_lines(current, previous)

    gone = len(set(before_d) - {_key(d) for d in destinations}) if previous else 0
    if not destinations:
        out.append(("no destinations in core"
                    + (f" ({gone} left core since the last refresh)" if gone else ""), False))
        return out
    rows, changed = [], []
    for d in destinations:
        old = before_d.get(_key(d))
        state = _state(d)
        if previous is not None and old is None:
            state = ("new " + state).strip()
        rows.append([_fmt(d.get("name")), _fmt(d.get("transport")),
                     f"{_fmt(d.get('window'))}/{_fmt(d.get('limit'))}",
                     _fmt(d.get("in_flight")), _delta(d, old, "in_flight"),
                     _fmt(d.get("queued_entries")), _fmt(d.get("queued_recipients")),
                     _delta(d, old, "queued_recipients"), _fmt(d.get("success")),
                     _fmt(d.get("failure")), _fmt(d.get("fail_cohorts")), state])
        changed.append(previous is not None and (old is None or _moved(d, old)))
    lines = _table(["DESTINATION", "TRANSPORT", "WINDOW/LIMIT", "IN FLIGHT", "±", "QUEUED",
                    "RCPTS", "±", "SUCCESS", "FAILURE", "COHORTS", "STATE"], rows)
    out += [(lines[0], False)] + list(zip(lines[1:], changed, strict=True))
    if gone:
        out.append((f"{gone} destination(s) left core since the last refresh", False))
    return out


def _class_lines(current: dict[str, object],
                 previous: dict[str, object] | None) -> list[tuple[str, bool]]:
    """Message classes (issue #34; only while they are on): each class's messages in
    the active queue against its room, with the change since the last refresh."""
    classes = current.get("classes")
    if not isinstance(classes, dict):
        return []
    old = previous.get("classes") if previous is not None else None
    before = {str(c.get("name")): c for c in _dicts(old.get("classes"))} \
        if isinstance(old, dict) else {}
    rows, changed = [], []
    for c in _dicts(classes.get("classes")):
        was = before.get(str(c.get("name")))
        rows.append([_fmt(c.get("name")), _fmt(c.get("active")), _fmt(c.get("cap")),
                     _delta(c, was, "active")])
        changed.append(was is not None and c.get("active") != was.get("active"))
    lines = _table(["CLASS", "ACTIVE", "ROOM", "±"], rows)
    return [(lines[0], False), *zip(lines[1:], changed, strict=True), ("", False)]


def _site_lines(current: dict[str, object],
                previous: dict[str, object] | None) -> list[tuple[str, bool]]:
    """Provider sites (issue #33; only while sites are on): in flight of the limit in
    force, with the change since the last refresh, and what holds each."""
    sites = _dicts(current.get("sites"))
    if not sites:
        return []
    before = {_key(x): x for x in _dicts(previous.get("sites"))} if previous else {}
    rows, changed = [], []
    for x in sites:
        old = before.get(_key(x))
        rows.append([_fmt(x.get("name")), _fmt(x.get("transport")),
                     _fmt(x.get("destinations")),
                     f"{_fmt(x.get('in_flight'))}/{_fmt(x.get('bound') or '-')}",
                     _delta(x, old, "in_flight"), _fmt(x.get("state")),
                     _fmt(x.get("rule") or "-")])
        changed.append(old is not None and _int(x.get("in_flight")) != _int(
            old.get("in_flight")))
    lines = _table(["SITE", "TRANSPORT", "DESTS", "IN FLIGHT/LIMIT", "±", "STATE", "RULE"],
                   rows)
    return [(lines[0], False), *zip(lines[1:], changed, strict=True), ("", False)]


def _source_lines(current: dict[str, object],
                  previous: dict[str, object] | None) -> list[tuple[str, bool]]:
    """Source pools' warm-up (issue #46; only while pools are on): each cold source's
    count at a site this window against its allowance, with the change since the last
    refresh (the largest 100 counts, as ``pyqmgr status``)."""
    sources = current.get("sources")
    if not isinstance(sources, dict):
        return []
    allowance: dict[str, object] = {}
    pools = sources.get("pools")
    for members in (pools.values() if isinstance(pools, dict) else ()):
        for m in _dicts(members):
            allowance[str(m.get("source"))] = m.get("allowance")
    old = previous.get("sources") if previous is not None else None
    before = {(str(c.get("source")), str(c.get("site"))): c
              for c in _dicts(old.get("counts"))} if isinstance(old, dict) else {}
    window = str(sources.get("window") or "day").upper()
    rows, changed = [], []
    for c in _dicts(sources.get("counts")):
        was = before.get((str(c.get("source")), str(c.get("site"))))
        rows.append([_fmt(c.get("source")), _fmt(c.get("site")),
                     f"{_fmt(c.get('counted'))}/{_fmt(allowance.get(str(c.get('source'))))}",
                     _delta(c, was, "counted"), _fmt(c.get("left"))])
        changed.append(was is not None and c.get("counted") != was.get("counted"))
    head = (f"sources: {_fmt(sources.get('waited'))} recipients waited, "
            f"{_fmt(sources.get('unknown_site'))} went warm before their site was known")
    fleet = _fleet_credit_line(sources, old if isinstance(old, dict) else None)
    if not rows:
        return [(head, False), *fleet, ("", False)]
    lines = _table(["SOURCE", "SITE", f"THIS {window}/ALLOWANCE", "±", "LEFT"], rows)
    return [(head, False), *fleet, (lines[0], False), *zip(lines[1:], changed, strict=True),
            ("", False)]


def _fleet_credit_line(sources: dict[str, object],
                       old: dict[str, object] | None) -> list[tuple[str, bool]]:
    """A fleet's warm-up (``shared_state``; only when the reply has its credits): the
    credits this server holds with their change, what it owes, and whether Redis
    answers (then the counts are the fleet's) or ``shared_state_failure`` is in force."""
    if "credits_held" not in sources:
        return []
    line = (f"fleet credits: {_fmt(sources.get('credits_held'))} held here"
            + (f" ({d})" if (d := _delta(sources, old, "credits_held")) else "")
            + f", {_fmt(sources.get('owed'))} owed; {_fmt(sources.get('credits_asked'))}"
            f" asked, {_fmt(sources.get('credits_granted'))} granted, "
            f"{_fmt(sources.get('credits_given_back'))} given back; ")
    if sources.get("fleet_unavailable"):
        line += (f"fleet UNAVAILABLE (shared_state_failure = "
                 f"{_fmt(sources.get('fleet_failure'))}: "
                 + ("counting here alone)" if sources.get("away") else
                    "no credits beyond those held)"))
    else:
        line += "Redis answers"
    moved = old is not None and any(sources.get(k) != old.get(k) for k in (
        "credits_held", "owed", "fleet_unavailable"))
    return [(line, moved)]


def _moved(now: dict[str, object], before: dict[str, object]) -> bool:
    return any(now.get(k) != before.get(k) for k in now if k not in ("retry_in",
                                                                  "rate_delayed_for"))


def title(config_dir: str, state: str, sort: str, when: float, keys: bool = True) -> str:
    clock = time.strftime("%H:%M:%S", time.localtime(when))
    return (f"pyqmgr top - {config_dir} - {clock} - {state} - sort {sort}"
            + (f" - {KEYS_HELP}" if keys else ""))


def screen(snap: Snapshot | None, previous: dict[str, object] | None, sort: str,
           config_dir: str, interval: float, paused: bool,
           width: int = 0) -> list[tuple[str, bool]]:
    """Everything on the screen: the title line, then the frame or the error.

    The error is wrapped to ``width`` (tables are cut instead: a wrapped row would
    no longer line up), so that a small terminal still says why there is no status.
    """
    when = snap.when if snap is not None else time.time()
    state = "PAUSED" if paused else f"every {interval:g}s"
    lines = [(title(config_dir, state, sort, when), False)]
    if snap is None:
        return lines + [("", False), ("asking the daemon...", False)]
    if snap.reply is None:
        text = snap.error or "no reply"
        wrapped = textwrap.wrap(text, width) if width > 10 else [text]
        return lines + [("", False)] + [(part, True) for part in wrapped] + [
            (f"asking again every {interval:g}s", False)]
    return lines + [("", False)] + frame(snap.reply, previous, sort)


def batch(fetch: Fetch, config_dir: str, interval: float, sort: str,
          iterations: int | None, write: Callable[[str], object],
          sleep: Callable[[float], None] = time.sleep) -> int:
    """Plain frames ``interval`` apart, as ``top -b`` prints them: ``iterations`` of
    them, or (None) until the caller is stopped; 0, or the first request's failure.

    A failed first request ends the run with its status (as ``pyqmgr status`` would):
    a script learns at once that there is nothing to read. A later one is that
    refresh's frame, saying why, and the next refresh asks again, as the screen does:
    a ``pyqmgr top > file`` left running sees the daemon through a ``postfix reload``.
    """
    previous: dict[str, object] | None = None
    i = 0
    while iterations is None or i < iterations:
        if i:
            sleep(interval)
        if iterations == 1:
            state = "snapshot"
        else:
            state = f"snapshot {i + 1}" + (f" of {iterations}" if iterations else "")
        lines = [title(config_dir, state, sort, time.time(), keys=False), ""]
        try:
            reply = fetch()
        except TopError as exc:
            if i == 0:
                raise
            lines += [str(exc), f"asking again in {interval:g}s"]
        else:
            lines += [text for text, _ in frame(reply, previous, sort)]
            previous = reply
        i += 1
        last = iterations is not None and i >= iterations
        write("\n".join(lines) + "\n" + ("" if last else "\n"))
    return 0


def interactive(stdscr: curses.window, fetch: Fetch, config_dir: str, interval: float,
                sort: str) -> int:
    """The live screen until q (or Ctrl-C, which the caller turns into a clean exit)."""
    try:
        curses.curs_set(0)
    except curses.error:  # a terminal without an invisible cursor: keep it
        pass
    stdscr.keypad(True)
    fit()
    snap: Snapshot | None = None
    # Deltas are between the two latest replies, kept as a pair so that a new sort
    # order redraws the same difference rather than a difference from itself.
    previous: dict[str, object] | None = None
    paused = False
    due = 0.0
    while True:
        if not paused and time.monotonic() >= due:
            try:
                reply = fetch()
            except TopError as exc:
                snap = Snapshot(time.time(), error=str(exc))
            else:
                if snap is not None and snap.reply is not None:
                    previous = snap.reply
                snap = Snapshot(time.time(), reply=reply)
            due = time.monotonic() + interval
        width = stdscr.getmaxyx()[1] - 1
        draw(stdscr, screen(snap, previous, sort, config_dir, interval, paused, width))
        wait = -1 if paused else max(0, int((due - time.monotonic()) * 1000))
        stdscr.timeout(wait)
        key = stdscr.getch()
        if key in (ord("q"), ord("Q")):
            return 0
        if key in (ord("s"), ord("S")):
            sort = SORT_CYCLE[(SORT_CYCLE.index(sort) + 1) % len(SORT_CYCLE)]
        elif key in (ord("p"), ord("P")):
            paused = not paused
            due = 0.0
        elif key == ord(" "):
            due = 0.0
        elif key == curses.KEY_RESIZE:
            fit()


def fit() -> None:
    """Make curses use the terminal's real size.

    curses takes LINES and COLUMNS from the environment over the terminal's own
    size, and a shell or a program above may have exported stale ones (pytest runs
    with COLUMNS=80 LINES=24): the kernel's window size is the truth.
    """
    try:
        size = os.get_terminal_size(sys.__stdout__.fileno() if sys.__stdout__ else 1)
    except (OSError, ValueError):
        curses.update_lines_cols()
        return
    if (curses.LINES, curses.COLS) != (size.lines, size.columns):
        curses.resizeterm(size.lines, size.columns)
    curses.update_lines_cols()


def draw(stdscr: curses.window, lines: list[tuple[str, bool]]) -> None:
    """The lines cut to the window; the last row says how many did not fit."""
    height, width = stdscr.getmaxyx()
    stdscr.erase()
    if height < 1 or width < 2:
        stdscr.refresh()
        return
    shown = lines
    if len(lines) > height:
        shown = lines[:height - 1] + [(f"... {len(lines) - height + 1} more lines "
                                       "(a bigger window shows them)", False)]
    for row, (text, changed) in enumerate(shown):
        attr = curses.A_REVERSE if row == 0 else (curses.A_BOLD if changed else 0)
        try:
            # width - 1: writing the bottom-right cell moves the cursor off the screen.
            stdscr.addnstr(row, 0, text, width - 1, attr)
        except curses.error:
            pass
    stdscr.refresh()
