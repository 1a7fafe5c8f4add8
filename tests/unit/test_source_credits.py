"""A fleet's warm-up credits in the core (pyqmgr/scheduler/source_credits.py, issue #46
item 2): one test per transition (taken, spent, run out, given back, a window's end,
the fleet away), and two books that share one count through a model of the Lua
script's grant never pass the plan together."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pyqmgr.scheduler.source import DAY, HOUR, OVERFLOW_WAIT, Pool, SourceBook, WarmupPlan
from pyqmgr.scheduler.source_credits import DRY_RETRY, IDLE_RETURN, credit_chunk
from pyqmgr.settings.sources import parse_start

START = parse_start("2026-11-20")
NOW = START + 12 * HOUR
PAIR = ("src1", "google")


def shared_book(allowance: int = 100, overflow: str = "warm") -> SourceBook:
    book = SourceBook({"bulk": Pool("bulk", ("src1", "src2", "src3"), (1, 1, 1))},
                      WarmupPlan(((0, allowance),), DAY, overflow), {"src1": START})
    book.share()
    return book


def route(book: SourceBook, n: int, now: float = NOW, tag: str = "r") -> Counter:
    return Counter(book.choose("bulk", "google", now, (tag, i)) for i in range(n))


def test_the_chunk_is_two_percent_of_the_allowance_at_least_one() -> None:
    assert [credit_chunk(a) for a in (0, 1, 49, 50, 100, 5000)] == [1, 1, 1, 1, 2, 100]


def test_no_credit_yet_the_cold_source_is_passed_over_and_its_credits_asked_for() -> None:
    book = shared_book()
    credits = book.credits
    assert credits is not None
    got = route(book, 6)
    assert got == Counter({"src2": 3, "src3": 3}), "no answer yet: the mail goes warm"
    assert credits.drain() == [("src1", "google", 100, 0)]
    assert credits.asking == {PAIR} and not credits.wanted, "asked once, not per recipient"
    assert book.counts == {} and book.status(NOW)["shared"] is True


def test_credits_taken_are_spent_one_a_recipient_and_asked_ahead() -> None:
    book = shared_book()
    credits = book.credits
    assert credits is not None
    route(book, 1)
    credits.drain()
    book.credited("src1", "google", book.window, 2, NOW)
    assert credits.held == {PAIR: 2} and not credits.asking
    got = route(book, 3, tag="a")
    assert got["src1"] == 1
    # Two credits are a chunk or fewer: the next chunk was asked for at once.
    assert credits.drain() == [("src1", "google", 100, 0)]
    assert credits.held[PAIR] == 1 and book.counts[PAIR] == 1
    reservation = next(r for r in book.reservations.values() if r.source == "src1")
    assert reservation.credited


def test_spent_with_the_next_chunk_on_its_way_the_mail_goes_warm() -> None:
    book = shared_book(overflow=OVERFLOW_WAIT)
    credits = book.credits
    assert credits is not None
    route(book, 1)
    credits.drain()
    book.credited("src1", "google", book.window, 1, NOW)
    got = route(book, 9, tag="b")
    # One credit, spent; the next chunk asked and not answered: src1 is passed over,
    # and even under overflow wait nothing waits for a round trip.
    assert got == Counter({"src1": 1, "src2": 4, "src3": 4}) and book.waited == 0


@pytest.mark.parametrize("overflow", ["warm", OVERFLOW_WAIT])
def test_run_out_fleet_wide_the_cold_source_is_full_until_the_retry(overflow: str) -> None:
    book = shared_book(overflow=overflow)
    credits = book.credits
    assert credits is not None
    route(book, 1)
    credits.drain()
    book.credited("src1", "google", book.window, 0, NOW)
    got = route(book, 9, tag="c")
    assert got["src1"] == 0
    if overflow == OVERFLOW_WAIT:
        # Full: its turn comes and its mail waits, as at its own allowance.
        assert got[None] == 3 and book.waited == 3
    else:
        assert got == Counter({"src2": 4, "src3": 5})
    assert not credits.wanted, "no question before the retry time"
    route(book, 1, now=NOW + DRY_RETRY, tag="d")
    assert credits.drain() == [("src1", "google", 100, 0)]


def test_a_reservation_given_back_is_a_credit_again_and_unused_goes_back() -> None:
    book = shared_book()
    credits = book.credits
    assert credits is not None
    route(book, 1)
    credits.drain()
    book.credited("src1", "google", book.window, 4, NOW)
    keys = [("e", i) for i in range(9)]
    chosen = [k for k in keys if book.choose("bulk", "google", NOW, k) == "src1"]
    assert len(chosen) == 3 and credits.held[PAIR] == 1
    book.started(chosen[0])
    book.ended(chosen[0], sent=True)  # delivered: stays counted
    book.ended(chosen[1], sent=False)  # deferred in core: its credit is back
    assert credits.held[PAIR] == 2 and book.counts[PAIR] == 2
    book.started(chosen[2])  # an agent has it: it is the fleet's count, kept
    assert book.unused() == [("src1", "google", 2)]
    assert credits.held == {}
    # A reservation still waiting in core goes back with the credits.
    book2 = shared_book()
    assert book2.credits is not None
    route(book2, 1)
    book2.credits.drain()
    book2.credited("src1", "google", book2.window, 3, NOW)
    chosen2 = [k for k in keys if book2.choose("bulk", "google", NOW, k) == "src1"]
    assert book2.unused() == [("src1", "google", 3)], chosen2
    assert not any(r.credited for r in book2.reservations.values())


def test_a_new_window_forgets_credits_and_drops_the_old_windows_answers() -> None:
    book = shared_book()
    credits = book.credits
    assert credits is not None
    route(book, 1)
    credits.drain()
    old = book.window
    book.credited("src1", "google", old, 4, NOW)
    tomorrow = NOW + DAY
    route(book, 1, now=tomorrow, tag="g")
    assert book.window == old + 1 and credits.held == {} and book.counts == {}
    assert credits.drain() == [("src1", "google", 100, 0)]
    book.credited("src1", "google", old, 4, tomorrow)  # late: of yesterday
    assert credits.held == {} and credits.asking == {PAIR}
    book.credited("src1", "google", old + 1, 2, tomorrow)
    assert credits.held == {PAIR: 2}


def test_the_fleet_away_counts_here_and_owes_what_it_took() -> None:
    book = shared_book(allowance=5)
    credits = book.credits
    assert credits is not None
    route(book, 1)
    credits.drain()
    credits.away = True  # shared_state_failure = local, Redis gone
    book.credited("src1", "google", book.window, 0, NOW, 1.0)
    got = route(book, 30, tag="h")
    assert got["src1"] == 5, "its own count against the plan, as a server alone"
    assert credits.spent == {PAIR: 5}
    taken = [k for k, r in book.reservations.items() if r.source == "src1"]
    book.ended(taken[0], sent=False)  # not reported yet: owed one fewer
    assert credits.spent == {PAIR: 4}
    route(book, 1, now=NOW + 1.0, tag="i")
    assert credits.drain() == [("src1", "google", 5, 4)] and credits.spent == {}
    credits.owe(PAIR, 4)  # that question failed too: owed with the next
    assert credits.spent == {PAIR: 4}


def test_two_servers_sharing_one_count_never_pass_the_plan() -> None:
    """Two books, each asking a shared count as the Lua script grants, the answers
    coming in any order: the cold source never passes the plan, every credit granted
    is spent or held, at most one a server once the fleet's allowance is nearly
    granted, and with mail enough on both it sends exactly the plan."""
    rng = random.Random(46)
    allowance = 100
    fleet_count = 0
    books = [shared_book(allowance) for _ in range(2)]
    in_flight: list[tuple[SourceBook, tuple[str, str, int, int]]] = []

    def answer(b: SourceBook, ask: tuple[str, str, int, int]) -> None:
        nonlocal fleet_count
        source, site, allow, owed = ask
        fleet_count += owed
        assert b.credits is not None
        grant = max(0, min(b.credits.want((source, site), allow), allow - fleet_count))
        fleet_count += grant
        b.credited(source, site, b.window, grant, NOW, room=allow - fleet_count)

    def deliver(book: SourceBook, key: tuple[str, int], fail: float) -> None:
        if book.choose("bulk", "google", NOW, key) == "src1":
            book.started(key)
            book.ended(key, sent=rng.random() >= fail)  # some deferred after all
        assert book.credits is not None
        in_flight.extend((book, ask) for ask in book.credits.drain())

    for step in range(1500):
        deliver(rng.choice(books), ("m", step), 0.1)
        rng.shuffle(in_flight)
        while in_flight and rng.random() < 0.5:
            answer(*in_flight.pop())
        cold = sum(b.counts.get(PAIR, 0) for b in books)
        held = sum(b.credits.held.get(PAIR, 0) for b in books if b.credits is not None)
        assert cold <= allowance and fleet_count <= allowance
        assert cold + held <= fleet_count
    while in_flight:
        answer(*in_flight.pop())
    cold = sum(b.counts.get(PAIR, 0) for b in books)
    held = sum(b.credits.held.get(PAIR, 0) for b in books if b.credits is not None)
    assert fleet_count == allowance and cold + held == allowance
    assert held <= 2, "near the end of the allowance, one credit a server at most"
    for step in range(100):  # mail goes on: the credits held are spent
        deliver(books[step % 2], ("n", step), 0.0)
    assert sum(b.counts.get(PAIR, 0) for b in books) == allowance


def test_credits_no_mail_asked_for_lately_are_taken_out_to_give_back() -> None:
    book = shared_book()
    credits = book.credits
    assert credits is not None
    route(book, 1)
    credits.drain()
    book.credited("src1", "google", book.window, 4, NOW)
    route(book, 3, tag="j")  # one of them cold: mail came for the pair at NOW
    assert credits.held[PAIR] == 3
    assert credits.idle([PAIR], NOW + IDLE_RETURN / 2) == []
    assert credits.idle([PAIR], NOW + IDLE_RETURN) == [("src1", "google", 3)]
    assert PAIR not in credits.held and credits.idle([PAIR], NOW + 9) == []


def test_near_the_end_of_the_allowance_one_credit_at_a_time_and_only_when_none() -> None:
    book = shared_book()
    credits = book.credits
    assert credits is not None
    route(book, 1)
    credits.drain()
    assert credits.want(PAIR, 100) == 2
    book.credited("src1", "google", book.window, 2, NOW, room=60)
    route(book, 3, tag="k")
    assert credits.drain(), "far from the end: the next chunk asked with one in hand"
    book.credited("src1", "google", book.window, 2, NOW, room=8)  # 4 chunks left
    assert credits.near_end(PAIR, 100) and credits.want(PAIR, 100) == 1
    held = credits.held[PAIR]
    assert held == 3
    i = 0
    while credits.held.get(PAIR, 0) > 0:
        book.choose("bulk", "google", NOW, ("l", i))
        i += 1
        assert not credits.wanted, "no question while a credit is in hand"
    assert i <= 3 * held
    route(book, 3, tag="m")  # the next cold turn finds none: one question
    assert credits.drain() == [("src1", "google", 100, 0)]
