"""finch and zmailer on real Postfix: what each policy promises, measured at the sink.

The sink times every delivery: its start is the RCPT command (one recipient per
delivery, so one RCPT each) and its end the accepted DATA; it answers RCPT after a
random latency (uniform, 0.5 to 1.5 times the mean, so deliveries that start together
do not all end together). Deliveries in flight at
once are counted from those intervals, per message (finch) or per destination
(zmailer). Connection caching is off, so a delivery is a session of its own.

finch's numbers come from allowed_new_worker with the default knobs (max message
concurrency 10, scale 10): a message may take another worker while it has fewer than
10 deliveries in flight, or fewer than 10 times the free workers (the transport's
process limit less its deliveries in flight and the agents already asked for). The
simulator shows the same numbers (tests/unit/test_policies_sim.py,
scenarios/finch-big-envelopes.toml).
"""

from __future__ import annotations

import random
import time

from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import SinkServer

MAX_CONC, SCALE = 10, 10
#: 42 agents: one message alone stops at 39 (39/42 = 92.9%; 10/11 continuously), and
#: two level messages at exactly 10 * 42 / 21 = 20 each (20/42 = 47.6%).
WORKERS = 42
#: Mean sink latency: with 40 agents this is about 65 deliveries a second, which the
#: 2-core test machine carries with the sink still seeing 93% of each agent's time;
#: the whole finch test takes about 20 s.
LATENCY = 0.6
NO_CACHE = {"smtp_connection_cache_on_demand": "no"}
#: How long after B's first RCPT an A delivery may still reach the sink's RCPT having
#: been handed to its agent before B entered the active queue: connect, greeting, EHLO
#: and MAIL through a sink whose one event loop is busy with 40 sessions (CI saw four
#: such A starts in the same millisecond, once in eight runs).
HANDED_BEFORE = 0.05

Interval = tuple[float, float]


def finch_alone(workers: int) -> int:
    """Deliveries one message reaches on an idle transport: fill while allowed."""
    c = 0
    while c < workers and (c < MAX_CONC or c < SCALE * (workers - c)):
        c += 1
    return c


def finch_level(workers: int, messages: int) -> float:
    """Each of ``messages`` level messages: c = scale * (workers - messages * c)."""
    return SCALE * workers / (1 + messages * SCALE)


class Timed:
    """The sink's latency rule that notes when each recipient's RCPT came."""

    def __init__(self, latency: float) -> None:
        self.latency = latency
        self.rng = random.Random(1)
        self.rcpt_at: dict[str, float] = {}

    def __call__(self, address: str) -> float:
        self.rcpt_at[address.lower()] = time.time()
        return self.rng.uniform(0.5 * self.latency, 1.5 * self.latency)

    def intervals(self, srv: SinkServer) -> dict[str, Interval]:
        """Recipient -> (RCPT time, DATA accepted time), for every accepted delivery."""
        return {m.recipients[0].lower(): (self.rcpt_at[m.recipients[0].lower()], m.time)
                for m in srv.messages()}


def in_flight(intervals: list[Interval], t0: float, t1: float) -> tuple[float, int]:
    """Time-weighted mean and most intervals open at once, over [t0, t1]."""
    busy = sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in intervals)
    events = sorted([(max(s, t0), 1) for s, e in intervals if s < t1 and e > t0]
                    + [(min(e, t1), -1) for s, e in intervals if s < t1 and e > t0])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return busy / (t1 - t0), most


def time_above(intervals: list[Interval], t0: float, t1: float, bound: int) -> float:
    """The share of [t0, t1] during which more than bound intervals are open at once."""
    events = sorted([(max(s, t0), 1) for s, e in intervals if s < t1 and e > t0]
                    + [(min(e, t1), -1) for s, e in intervals if s < t1 and e > t0])
    above, now, since = 0.0, 0, t0
    for t, step in events:
        if now > bound:
            above += t - since
        now, since = now + step, t
    return above / (t1 - t0)


def frange(start: float, stop: float, step: float) -> list[float]:
    return [start + i * step for i in range(int((stop - start) / step))]


def test_finch_big_envelopes_share_the_agents(postfix_instance, sink):
    """One big envelope alone holds 39 of 42 agents; with a second, 20 each.

    The sink sees each delivery from RCPT to the accepted DATA, a fixed part of the
    time its agent is held (connecting, the greeting, reporting back to the queue
    manager and being handed the next request are the rest). While A is alone the
    policy pins it at its cap, so the most deliveries in flight at once is its agent
    count, and the mean over the same time measures that part; the two messages'
    means are scaled by it to say how many agents each holds.
    """
    timed = Timed(LATENCY)
    srv: SinkServer = sink(latency=timed)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", pyqmgr_cf={"scheduler_policy": "finch"},
        transports={"big.example": f"fast:[127.0.0.1]:{srv.port}"},
        master_cf_extra=[f"fast unix - - n - {WORKERS} smtp"],
        # One recipient per delivery: every recipient is a queue of its own, so no
        # destination window limits a message, only the policy.
        main_cf={"fast_destination_recipient_limit": "1", **NO_CACHE})
    n_a, n_b = 700, 300
    pf.smtp_send([("s@test.example", [f"a{i}@big.example" for i in range(n_a)])])
    pf.wait_until(lambda: len(srv.messages()) >= 60, 60, "A under way")
    time.sleep(2.5)
    pf.smtp_send([("s@test.example", [f"b{i}@big.example" for i in range(n_b)])])
    b_queued = time.time()
    pf.wait_until(lambda: len(srv.messages()) >= n_a + n_b, 90, "A and B at the sink")
    got = timed.intervals(srv)
    assert len(got) == n_a + n_b, "every recipient once"
    a = [iv for r, iv in got.items() if r.startswith("a")]
    b = [iv for r, iv in got.items() if r.startswith("b")]
    a_first, b_first = min(s for s, _ in a), min(s for s, _ in b)
    b_last = max(s for s, _ in b)

    # A alone, after its ramp-up: at its cap, bin after bin.
    alone = finch_alone(WORKERS)
    t0, t1 = a_first + 1.0, b_first
    seen, most = in_flight(a, t0, t1)
    bins = [in_flight(a, t, t + 0.25)[1] for t in frange(t0, t1 - 0.25, 0.25)]
    part = seen / most
    print(f"\nfinch, {WORKERS} agents, A alone: {most}/{WORKERS} = {most / WORKERS:.1%} "
          f"(theory {alone}/{WORKERS} = {alone / WORKERS:.1%}); at most {bins} per 0.25 s; "
          f"{seen:.1f} seen at the sink on average ({part:.0%} of each agent's time)")
    assert abs(most / WORKERS - alone / WORKERS) <= 0.03
    assert sum(1 for m in bins if m >= alone - 2) >= 0.75 * len(bins), bins

    # B takes over as A's deliveries end: A starts nothing new until B is level.
    level = finch_level(WORKERS, 2)
    steps = [in_flight(b, t, t + 0.05)[0] for t in frange(b_first, b_first + 1.0, 0.05)]
    b_starts = sorted(s for s, _ in b)
    t_level = next(t for t in b_starts if in_flight(b, t, t + 1e-6)[1] >= level - 2)
    # An agent the queue manager handed an A delivery just before B came in reaches
    # RCPT a few round trips later through the busy sink: not a new choice of A.
    a_new = [s for s, _ in a if b_first + HANDED_BEFORE <= s < t_level]
    a_late = [round(s - b_first, 3) for s, _ in a if b_first <= s < b_first + HANDED_BEFORE]
    # A delivery reaches the queue manager a moment after the sink accepted it.
    a_ended = [e for _, e in a if b_first - 0.1 <= e < t_level]
    print("B in flight, 0.05 s steps from its first delivery: "
          + " ".join(f"{c:.1f}" for c in steps))
    print(f"B at {level - 2:g} after {t_level - b_first:.2f} s; meanwhile A's deliveries "
          f"ended {len(a_ended)}, started {len(a_new)} (and {a_late} s after B's first, "
          "handed out before B)")
    assert steps[0] < level / 2 and max(steps) >= level - 4, steps
    assert len(a_new) <= 3, "A kept taking agents while B caught up"
    assert len(a_ended) >= level - 2 - (WORKERS - alone) - 2, "B took agents A held"

    # Both level, once B caught up, until B runs out. B runs out when the queue manager
    # hands out its last recipient, which the sink sees as that agent's RCPT some time
    # later: from then on A rightly takes the agents B frees. That time grows with the
    # machine's load, so it is measured: B's first RCPT came no sooner after B was
    # queued than an agent takes from being handed a delivery to its RCPT.
    lag = max(0.3, b_first - b_queued)
    t0, t1 = t_level + 0.5, b_last - lag
    assert t1 - t0 > 2, "too short a time with both messages"
    (seen_a, most_a), (seen_b, most_b) = in_flight(a, t0, t1), in_flight(b, t0, t1)
    held_a, held_b = seen_a / part, seen_b / part
    print(f"finch, two: A holds {held_a:.1f} = {held_a / WORKERS:.1%}, B {held_b:.1f} = "
          f"{held_b / WORKERS:.1%} (theory {level:g}/{WORKERS} = {level / WORKERS:.1%} "
          f"each); at most A {most_a}, B {most_b}; of the deliveries in flight A "
          f"{seen_a / (seen_a + seen_b):.1%}; until {lag:.2f} s before B's last RCPT")
    for held in (held_a, held_b):
        assert abs(held / WORKERS - level / WORKERS) <= 0.03
    # A message may hold a few more than its share for a moment: CI's loaded machine saw
    # A at 25 once (level + 5) while the means were level to 0.1 agent. What must hold
    # is that neither message keeps more for more than a sliver of the time.
    over = max(time_above(a, t0, t1, int(level) + 4), time_above(b, t0, t1, int(level) + 4))
    print(f"more than {int(level) + 4} in flight for {over:.2%} of the time")
    assert over <= 0.02, f"a message held more than its share for {over:.1%} of the time"


def test_zmailer_one_agent_per_destination_in_age_order(postfix_instance, sink):
    """Six destinations, eight messages each, three agents: ZMailer's thread rules.

    A thread is a destination queue, and Postfix names queues by next hop: each
    destination gets a sink of its own (one port each), or all six would be one queue.
    """
    timed = Timed(0.2)
    dests = [f"d{j}.example" for j in range(6)]
    sinks: dict[str, SinkServer] = {d: sink(latency=timed) for d in dests}
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", pyqmgr_cf={"scheduler_policy": "zmailer"},
        transports={d: f"three:[127.0.0.1]:{srv.port}" for d, srv in sinks.items()},
        master_cf_extra=["three unix - - n - 3 smtp"], main_cf=NO_CACHE)
    rcpts = [f"m{k}@{dests[k % 6]}" for k in range(48)]
    qids = pf.smtp_send([("s@test.example", [r]) for r in rcpts])
    pf.wait_until(lambda: sum(len(srv.messages()) for srv in sinks.values()) >= 48, 60,
                  "48 messages at the sinks")
    pf.wait_queue_empty(30)
    got: dict[str, Interval] = {}
    for d, srv in sinks.items():
        mine = timed.intervals(srv)
        assert all(r.endswith("@" + d) for r in mine)
        got.update(mine)
    assert sorted(got) == sorted(rcpts), "every recipient once"
    qid_of = dict(zip(rcpts, qids, strict=True))
    active = [ln.queue_id for ln in pf.maillog.lines(program="qmgr")
              if ln.text.endswith("(queue active)")]
    age = {qid: i for i, qid in enumerate(active)}
    assert set(age) == set(qids)

    t0, t1 = min(s for s, _ in got.values()), max(e for _, e in got.values())
    for d in dests:
        mine = {r: iv for r, iv in got.items() if r.endswith("@" + d)}
        assert in_flight(list(mine.values()), t0, t1)[1] == 1, f"two agents on {d}"
        assert sinks[d].snapshot().max_concurrent == 1, f"two sessions at {d}"
        served = sorted(mine, key=lambda r: mine[r][0])
        by_age = sorted(mine, key=lambda r: age[qid_of[r]])
        assert served == by_age, (d, served, by_age)
    # One delivery per destination, so deliveries at once are destinations at once.
    _, most = in_flight(list(got.values()), t0, t1)
    order = "".join(r[r.index("@d") + 2] for r in sorted(got, key=lambda r: got[r][0]))
    print(f"\nzmailer: at most {most} destinations at once with 3 agents (theory 3); "
          f"destinations in delivery order: {order}; took {t1 - t0:.1f} s")
    assert most == 3
