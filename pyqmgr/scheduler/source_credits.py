"""A fleet's warm-up counts as credits (issue #46 item 2), I/O-free.

With ``shared_state`` (a fleet) the servers that share a cold source's address share
its count at each site in the window: the fleet as a whole sends the plan. Routing
runs synchronously on the event loop, a recipient at a time, and must never wait for
Redis; so each server holds *credits* per (source, site), taken from the fleet's
count in chunks by one atomic step (the daemon's side: :mod:`pyqmgr.fleet.warmup`,
which grants ``min(chunk, allowance - taken fleet-wide)``), and a recipient chosen
for a cold source spends one here. What is plain numbers is here; the daemon feeds
the answers in (:meth:`SourceBook.credited`) and takes out what to ask for
(:meth:`Credits.drain`) and what to give back (:meth:`SourceBook.unused`).

* **Asked ahead.** A pair's credits are asked for when they fall to a chunk or fewer
  (a chunk is ``allowance // 50``, at least 1), so that the pair rarely runs dry
  while its next chunk is on its way. Near the end of the fleet's allowance (the
  last answer left :data:`NEAR_END` chunks or fewer) a server asks for one credit
  at a time and only when it holds none: what servers hold unspent when their mail
  stops is the plan's shortfall, one credit a server at most there.
* **Not answered yet** (a pair's first question of the window, or credits spent
  before the next chunk came): the cold source is passed over for that recipient,
  which goes to a warm member, as before its site is known. Deferring it for a
  round trip would cost it a whole backoff under ``overflow wait``.
* **None left fleet-wide** (the fleet's answer was 0): the cold source is full
  there, as a server's own count at its allowance is (its mail goes warm, or waits
  with ``overflow wait``), until :data:`DRY_RETRY` later a question finds credits
  another server gave back.
* **Given back.** A reservation given back (its delivery never left) is a credit
  again here. Once the fleet has granted the whole allowance, credits no mail asked
  for in :data:`IDLE_RETURN` go back (:meth:`Credits.idle`), so that a server whose
  mail for the site stopped does not keep them from one whose mail goes on (which
  asks again every :data:`DRY_RETRY`). The credits held, and the reservations still
  waiting in core, go back to the fleet when the process exits
  (:meth:`SourceBook.unused`); at a window's end they are simply forgotten: the next
  window counts in a new key.
* **The fleet away** (Redis slow or gone, ``shared_state_failure = local``): the
  server counts against its own count as without a fleet (:attr:`away`), and what
  it took without credit is :attr:`spent`, added to the fleet's count at the next
  answer. With ``hold`` the daemon answers 0 instead: the cold source takes no
  more than the credits it holds.
"""

from __future__ import annotations

from collections.abc import Iterable

#: What :meth:`Credits.check` says of a cold source at a site.
TAKE, FULL, UNSURE = 0, 1, 2
#: Seconds after the fleet said "none left" before a pair asks again: another server
#: may have given credits back meanwhile (a reload gives back what its qmgr held while
#: the new one already asks). A question per pair every 2 s, and only while mail
#: comes for a cold source that is full.
DRY_RETRY = 2.0
#: Seconds a pair's credits may lie unused, once the fleet has none left to grant,
#: before they go back to it.
IDLE_RETURN = 1.0
#: Chunks left fleet-wide, at the last answer, below which a server asks for one
#: credit at a time, and only when it holds none.
NEAR_END = 4


def credit_chunk(allowance: int) -> int:
    """Credits a server asks for at once: 2% of the allowance, at least 1."""
    return max(1, allowance // 50)


class Credits:
    """One server's credits per (source, site) in the current window."""

    __slots__ = ("held", "asking", "wanted", "dry", "spent", "away", "used", "room")

    def __init__(self) -> None:
        #: (source, site) -> credits held, not spent yet.
        self.held: dict[tuple[str, str], int] = {}
        #: Pairs asked for whose answer has not come yet.
        self.asking: set[tuple[str, str]] = set()
        #: Pairs to ask for, with their allowance: the daemon drains it.
        self.wanted: dict[tuple[str, str], int] = {}
        #: Pairs the fleet had none left for: not asked again before the time.
        self.dry: dict[tuple[str, str], float] = {}
        #: Recipients counted without credit while the fleet was away, not yet added
        #: to the fleet's count.
        self.spent: dict[tuple[str, str], int] = {}
        #: The fleet does not answer and shared_state_failure is local: count here.
        self.away = False
        #: When mail last came for each pair (:meth:`idle`).
        self.used: dict[tuple[str, str], float] = {}
        #: What the fleet had left to grant for each pair at its last answer.
        self.room: dict[tuple[str, str], int] = {}

    def clear(self) -> None:
        """A new window: nothing held, asked or owed (the old window's key expires)."""
        self.held.clear()
        self.asking.clear()
        self.wanted.clear()
        self.dry.clear()
        self.spent.clear()
        self.used.clear()
        self.room.clear()

    def near_end(self, pair: tuple[str, str], allowance: int) -> bool:
        """Whether the fleet had :data:`NEAR_END` chunks or fewer left at the last
        answer: then one credit at a time."""
        room = self.room.get(pair)
        return room is not None and room <= NEAR_END * credit_chunk(allowance)

    def want(self, pair: tuple[str, str], allowance: int) -> int:
        """How many credits to ask for: a chunk, or near the end one."""
        return 1 if self.near_end(pair, allowance) else credit_chunk(allowance)

    def check(self, pair: tuple[str, str], allowance: int, counted: int, now: float) -> int:
        """May the cold source take one more recipient at the site: TAKE, FULL, or
        UNSURE (no answer yet: pass it over). Asks for more when low."""
        held = self.held.get(pair, 0)
        self.used[pair] = now
        low = 0 if self.room and self.near_end(pair, allowance) else credit_chunk(allowance)
        if held <= low and pair not in self.asking and (
                not self.dry or now >= self.dry.get(pair, 0.0)):
            self.asking.add(pair)
            self.wanted[pair] = allowance
        if held > 0:
            return TAKE
        if self.away:
            return TAKE if counted < allowance else FULL
        return UNSURE if pair in self.asking else FULL

    def take(self, pair: tuple[str, str]) -> bool:
        """One recipient counted: a credit spent (True), or, away, owed (False)."""
        held = self.held.get(pair, 0)
        if held > 0:
            self.held[pair] = held - 1
            return True
        self.spent[pair] = self.spent.get(pair, 0) + 1
        return False

    def give(self, pair: tuple[str, str], credited: bool) -> None:
        """A reservation given back: its credit is one to spend again; one owed and not
        yet added to the fleet's count is owed no more."""
        if not credited and self.spent.get(pair, 0) > 0:
            self.spent[pair] -= 1
            return
        self.held[pair] = self.held.get(pair, 0) + 1

    def drain(self) -> list[tuple[str, str, int, int]]:
        """What to ask the fleet for now: (source, site, allowance, owed), each pair's
        owed count taken out (:meth:`owe` puts it back when the question failed)."""
        out = [(s, site, allowance, self.spent.pop((s, site), 0))
               for (s, site), allowance in self.wanted.items()]
        self.wanted.clear()
        return out

    def owe(self, pair: tuple[str, str], n: int) -> None:
        """Owed counts a failed question carried: added to the next one."""
        if n:
            self.spent[pair] = self.spent.get(pair, 0) + n

    def answered(self, pair: tuple[str, str], granted: int, now: float,
                 retry: float = DRY_RETRY, room: int | None = None) -> None:
        """The fleet granted ``granted`` credits (0: none left, ask again after
        ``retry`` seconds) and had ``room`` left to grant after (None: not known)."""
        self.asking.discard(pair)
        if room is not None:
            self.room[pair] = room
        if granted > 0:
            self.held[pair] = self.held.get(pair, 0) + granted
            self.dry.pop(pair, None)
        else:
            self.dry[pair] = now + retry

    def idle(self, pairs: Iterable[tuple[str, str]], now: float,
             after: float = IDLE_RETURN) -> list[tuple[str, str, int]]:
        """Of ``pairs``, the credits no mail asked for in ``after`` seconds, taken out
        to give back: (source, site, credits)."""
        out = []
        for pair in pairs:
            n = self.held.get(pair, 0)
            if n > 0 and now - self.used.get(pair, 0.0) >= after:
                del self.held[pair]
                out.append((pair[0], pair[1], n))
        return out

    def status(self, limit: int = 100) -> dict[str, object]:
        """Credits held (the ``limit`` pairs holding most), owed, and whether away."""
        top = sorted(((n, pair) for pair, n in self.held.items() if n > 0), reverse=True)
        return {"credits_held": sum(self.held.values()),
                "credits": [{"source": s, "site": site, "credits": n}
                            for n, (s, site) in top[:limit]],
                "owed": sum(self.spent.values()), "away": self.away,
                "dry": len(self.dry)}
