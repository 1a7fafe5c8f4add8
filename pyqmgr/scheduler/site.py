"""Provider sites: destinations grouped by where their mail really goes (issue #33).

Postfix's limits count per next-hop domain, and so does its feedback: 300 Google
Workspace domains get 300 windows and may open 300 times
``smtp_destination_concurrency_limit`` sessions to one provider, and a
``421 4.7.28`` that one domain earns slows none of the others. A provider counts per
site, the hosts its MX records name. Here a :class:`~.structures.Site` groups the
in-core destination queues of one transport that share a site and caps their sum of
deliveries in flight; each destination keeps stock's own window below that cap.

Which site a domain is at comes from outside the core, which does no I/O: when a
queue is made for a domain whose site is not known (or whose answer expired), the
core asks for a lookup in the event's decisions (``Decisions.resolve``) and, until
the answer comes, counts the domain as a site of its own, so mail never waits on
DNS. The driver answers with :meth:`~.core.Scheduler.site_learnt` (the daemon from
the MX records, the simulator from its scenario, replay from the log's ``relay=``
hosts); the domain's queues then move to their site, deliveries in flight and all.
Delivery is untouched: the agent still gets the domain as its next hop and chooses
the MX host itself.

A full site gates its members (``Queue.gate``, the attribute every policy tests,
joins a queue's own gate and its site's) until one of its deliveries ends; the gate's
text is what explain says. The gate is the site's alone: closing and opening a site
visit none of its members. The transport indexes the open sites whose members could
take a delivery (``Transport.ready_sites``, each site its own ``Site.ready``), and a
policy hears that a site opened once (``Policy.site_opened``; nqmgr clears its
blocker tags in O(1)), so a saturated site of 100,000 domains costs what one of 30
does (issue #44: before, every delivery at a full site walked every member, 6.9 ms a
delivery with 10,000 of them). Everything here is O(1) per event but a lookup's
answer, which moves the domain's own queues.

The structures (:class:`~.structures.Site`, the core's :class:`~.structures.SiteTable`)
are declared in :mod:`.structures`; the verbs that change them are here.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

from pyqmgr.durations import duration
from pyqmgr.scheduler.gates import regate
from pyqmgr.scheduler.scope import ScopeKind
from pyqmgr.scheduler.shaping import (
    Gate,
    Rule,
    Shape,
    effective_interval,
    observed_rate,
    recovery_step,
    recovery_text,
    triggered,
)
from pyqmgr.scheduler.structures import (
    BACKOFF_GATE,
    LOOKUP_GATE,
    RATE_GATE,
    SITE_GATE,
    Site,
    site_domain,
)

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Entry, Queue

def site_attach(core: Core, queue: Queue) -> None:
    """A new queue joins its site (``queue_obtain``), when its transport has sites."""
    table = core.sites
    assert table is not None
    limits = table.limits(queue.transport.name)
    if limits is None:
        return
    domain = site_domain(queue.nexthop)
    if domain is None or queue.nexthop in table.skip or domain in table.skip:
        return
    name = table.name_of(domain, core.now, core.out.resolve)
    site = table.site(queue.transport.name, name, limits)
    if (table.wait > 0 and name == domain and domain in table.asked and not site.members
            and site.gate is None and domain not in table.known):
        # The first lookup is under way (a local resolver answers in milliseconds):
        # wait for it a moment, or the domain's first deliveries count at a site of
        # their own and overrun the real site's limit.
        until = wait_end(core.now + table.wait)
        _shut(core, site, Gate(LOOKUP_GATE, until, "site_dns_wait in pyqmgr.cf",
                               f"the MX lookup of {domain} is under way"))
        _due(core, site, until)
    _join(core, queue, site)


#: A lookup's wait ends on a grid of this many seconds (:func:`wait_end`).
WAIT_GRAIN = 0.05


def wait_end(when: float) -> float:
    """When a lookup's wait that would end at ``when`` ends: the next point of a
    50 ms grid, so up to 50 ms later.

    Every new domain's first queue waits for its lookup (``site_dns_wait``), and the
    answer nearly always comes first (a local resolver answers in milliseconds), so
    the wait's deadline is a wake-up for nothing. With a deadline of its own, a burst
    of new domains asked the daemon for a wake-up every 5 ms (its timer grain) for as
    long as they came: 729 wake-ups instead of 337 for 1,000 messages over 3,000
    domains. On the grid a burst asks for one per 50 ms; a lookup slow enough to
    meet its deadline waits a few milliseconds more."""
    return math.ceil(when / WAIT_GRAIN - 1e-9) * WAIT_GRAIN


def site_speaks(core: Core, queue: Queue, reason: str | None) -> bool:
    """Does a member's reply speak for its whole site: may it throttle, suspend, kill
    the site or hold a tenant there (issue #45)? Only when it came from one of the
    site's own hosts (``SiteTable.replied_from``), or the domain is the admin's
    (pinned) or its own site. Otherwise it moves only the member's destination: a
    domain's owner may point its MX records elsewhere after qmgr looked them up."""
    site, table = queue.site, core.sites
    if site is None or table is None or table.replied_from is None:
        return site is not None
    domain = site_domain(queue.nexthop)
    if domain is not None and (domain in table.pinned or domain == site.name.lower()):
        return True
    return table.replied_from(site.name, reason or "")


def site_lookup_waits(core: Core, domains: tuple[str, ...], until: float) -> None:
    """The driver's lookups of these domains are answered, or their wait ends, by
    ``until``: each one's own site, still held for its first lookup, is held until
    then instead.

    A new domain's wait (``site_dns_wait``) starts when the core first sees it, but
    the driver runs a bounded number of lookups at once: with thousands of new
    domains the rest wait their turn, and a wait that ran out before its query was
    even sent let the domain's first deliveries count at a site of their own (57 of
    10,000 sessions refused at a 10-session MX on a busy machine). So the driver
    holds a queued lookup's domain longer (to its lookup's timeout) and, when the
    query goes, gives it its wait from then. One look-up per transport, as
    :func:`site_learnt`."""
    table = core.sites
    if table is None:
        return
    for domain in domains:
        domain = domain.lower()
        if domain not in table.asked:
            continue  # answered already
        for transport in core.transports:
            site = table.sites.get((transport, domain))
            gate = site.gate if site is not None else None
            if site is None or gate is None or gate.kind != LOOKUP_GATE:
                continue  # not held: its wait ran out, or it never waited
            site.gate = Gate(LOOKUP_GATE, wait_end(until), gate.setting, gate.text)
            _due(core, site, site.gate.until)


def _join(core: Core, queue: Queue, site: Site) -> None:
    t = queue.transport
    t.ready_queues.pop(queue, None)
    queue.site = site
    queue.chain = SITE_CHAIN
    site.members[queue] = None
    site.busy += queue.busy_count
    t.sync(queue)  # indexed at its site now
    if site.gate is None and site.full:
        _close(core, site)


def _shut(core: Core, site: Site, gate: Gate) -> None:
    """The site closes (or its gate changes): its members are out of the transport's
    ready work at once, none of them visited."""
    site.gate = gate
    t = core.transports.get(site.transport)
    if t is not None:
        t.ready_sites.pop(site, None)


def _open(core: Core, site: Site) -> None:
    """The site opens: its ready members are the transport's ready work again, and
    its policy hears it once."""
    site.gate = None
    t = core.transports.get(site.transport)
    if t is None:
        return
    if site.ready:
        t.ready_sites[site] = None
    if not t.broken:
        t.policy.site_opened(site)


def _open_timed(core: Core, site: Site) -> None:
    """A site's timed gate (its lookup's wait, a backoff) ends: its members deliver,
    unless the site is full."""
    if site.gate is not None and site.gate.kind != SITE_GATE:
        if site.full:
            _close(core, site)
        else:
            _open(core, site)


def _stop_waiting(core: Core, site: Site) -> None:
    if site.gate is not None and site.gate.kind == LOOKUP_GATE:
        _open_timed(core, site)
        if core.sites is not None and (site.shape is None or site.shape.rule is None):
            core.sites.due.pop(site, None)


def _due(core: Core, site: Site, when: float) -> None:
    table = core.sites
    assert table is not None
    if when < table.due.get(site, math.inf):
        table.due[site] = when
        table.due_order += 1
        heapq.heappush(table.due_heap, (when, table.due_order, site))
        if len(table.due_heap) > 2 * len(table.due) + 64:
            # Times dropped or moved earlier leave entries behind: compact.
            table.due_heap = [(at, k, s) for k, (s, at) in enumerate(table.due.items())]
            heapq.heapify(table.due_heap)
        core.out.timers.append(when)


#: How long a full site still counts a delivery that ended: smtp(8) does not wait for
#: the reply to its QUIT (``smtp_skip_quit_response = yes``), so the agent reports
#: while the remote server may not have read the QUIT yet, and a delivery started at
#: once can reach it first and be one session too many (1 of 101 sessions refused in
#: one real run at 200 ms a message). The fleet waits as long (daemon.fleet.node.QUIT_GRACE).
QUIT_GRACE = 0.005


def site_ended(core: Core, site: Site) -> bool:
    """A member's delivery ended: counted down now (True), or, while the site is
    full, after QUIT_GRACE (False; ``site_due`` counts it down and opens the site)."""
    if site.full:
        site.quitting.append(core.now + QUIT_GRACE)
        _due(core, site, site.quitting[0])
        return False
    site.busy -= 1
    return True


def site_due(core: Core, now: float) -> None:
    """Time passed (``tick``): lookups' waits and backoffs end, throttled sites step
    back up, deliveries that ended at a full site stop counting."""
    table = core.sites
    if table is None or not table.due:
        return
    heap = table.due_heap
    came: list[Site] = []
    while heap and heap[0][0] <= now:
        when, _, site = heapq.heappop(heap)
        if table.due.get(site) == when:
            del table.due[site]
            came.append(site)
    for site in came:
        quit_ended = False
        while site.quitting and site.quitting[0] <= now:
            site.quitting.popleft()
            site.busy -= 1
            quit_ended = True
        if quit_ended:
            site_settle(core, site)
        if site.gate is not None and site.gate.kind != SITE_GATE and site.gate.until <= now:
            _open_timed(core, site)
        shape = site.shape
        if shape is not None and shape.rule is not None:
            _step_up(core, site, now)
        nxt = min(site.gate.until if site.gate is not None and site.gate.kind != SITE_GATE
                  else math.inf, shape.next_step if shape is not None and shape.rule
                  else math.inf, site.quitting[0] if site.quitting else math.inf)
        if nxt < math.inf:
            _due(core, site, nxt)
        elif not site.members:
            _forget_if_neutral(core, site)


def site_throttled(core: Core, site: Site, rule: Rule, now: float, started: float) -> None:
    """A member's reply matched a throttling rule: the whole site slows, at once.

    A provider that answers ``421 4.7.28`` to one of its customers' domains is
    answering for all of them: the rule's window factor caps the site's deliveries
    in flight (from those in flight now), its ``suspend`` holds every member. One
    reduction per round trip, as for a destination: replies to deliveries started
    before the last cut were sent at the old pace.
    """
    shape = site.shape
    if shape is None:
        shape = site.shape = Shape()
    if not triggered(rule, shape, now) or started < shape.last_cut:
        return
    shape.matches.clear()
    shape.last_cut = shape.last_match = now
    shape.rule = rule
    done = []
    if rule.window is not None:
        cap = max(rule.window_floor, math.floor(site.busy * rule.window))
        if shape.cap:
            cap = min(cap, shape.cap)
        shape.cap = cap
        _bound(site)
        done.append(f"site capped at {cap} ({site.busy} in flight)")
    shaping = site.limits.shaping if site.limits is not None else None
    if rule.rate is not None and shaping is not None:
        if shaping.rate is None and shape.rate_factor >= 1.0:
            shape.learnt_rate = observed_rate(shape, now)
        if shaping.rate is not None or shape.learnt_rate > 0:
            shape.rate_factor *= rule.rate
            done.append(f"site rate lowered to one start every "
                        f"{duration(effective_interval(shaping, shape))}")
    if rule.suspend is not None:
        _hold(core, site, BACKOFF_GATE, now + rule.suspend, rule.where,
              f"site {site.name} is held back {duration(rule.suspend)} after a throttling "
              f"reply ({rule.describe()})")
        done.append(f"held back {duration(rule.suspend)}")
    if site.gate is None and site.full:
        _close(core, site)
    shape.next_step = now + rule.quiet
    _due(core, site, min(shape.next_step, site.gate.until if site.gate is not None
                         and site.gate.kind != SITE_GATE else math.inf))
    core.out.log.append(("info", f"sites: site {site.name} ({site.transport}): throttling "
                                 f"reply matched {rule.where}: "
                                 f"{', '.join(done) or 'counted'}"))


def _bound(site: Site) -> None:
    cap = site.shape.cap if site.shape is not None else 0
    site.bound = min(site.limit, cap) if site.limit and cap else (site.limit or cap)


def _step_up(core: Core, site: Site, now: float) -> None:
    """A quiet interval passed with no throttling reply: give one step back."""
    shape = site.shape
    assert shape is not None and shape.rule is not None
    rule = shape.rule
    if now < shape.next_step:
        return
    if recovery_step(shape, rule, now, site.limit):
        what = recovery_text(shape, rule, "site")
    else:
        what = "throttling over"
    _bound(site)
    site_settle(core, site)
    core.out.log.append(("info", f"sites: site {site.name} ({site.transport}): {what}"))


def site_leave(core: Core, queue: Queue) -> None:
    """A queue leaves its site (discarded, or moved to the site a lookup found)."""
    site = queue.site
    assert site is not None
    queue.site = None
    queue.chain = ()
    site.members.pop(queue, None)
    site.ready.pop(queue, None)
    if not site.ready:
        queue.transport.ready_sites.pop(site, None)
    site.busy -= queue.busy_count
    site_settle(core, site)
    if not site.members:
        _forget_if_neutral(core, site)


def _forget_if_neutral(core: Core, site: Site) -> None:
    """An empty site goes once nothing of it matters any more: a response rule's cap
    or rate, a rate's spacing or a backoff must hold for the domains' next mail too
    (a site whose queues all went idle between two deferred-queue scans came back
    at its full limit and met the provider's 421s again)."""
    table = core.sites
    if table is None or site.members:
        return
    shape = site.shape
    if shape is not None and shape.rule is not None:
        return
    if shape is not None and shape.tat > core.now:
        _due(core, site, shape.tat)
        return
    if site.gate is not None and site.gate.kind != SITE_GATE:
        return
    table.sites.pop((site.transport, site.name), None)
    table.due.pop(site, None)


def site_started(core: Core, queue: Queue) -> None:
    """A delivery to a member started: the site may be full now, or have to wait for
    its next start (a site rate, or one a response rule lowered)."""
    site = queue.site
    assert site is not None
    site.busy += 1
    shape = site.shape
    if shape is None:
        shape = site.shape = Shape()
    shape.starts.append(core.now)
    limits = site.limits
    shaping = limits.shaping if limits is not None else None
    interval = effective_interval(shaping, shape) if shaping is not None else 0.0
    if interval > 0:
        shape.tat = max(shape.tat, core.now) + interval
        if shape.tat > core.now + 1e-9:
            _hold(core, site, RATE_GATE, shape.tat, _rate_setting(site),
                  f"site {site.name} starts a delivery at most every {duration(interval)}")
            return
    if site.gate is None and site.full:
        _close(core, site)


def _rate_setting(site: Site) -> str:
    shape, limits = site.shape, site.limits
    if shape is not None and shape.rule is not None and shape.rate_factor < 1.0:
        return shape.rule.where
    return limits.rate_setting if limits is not None else "site_rate in pyqmgr.cf"


def _hold(core: Core, site: Site, kind: str, until: float, setting: str, text: str) -> None:
    """Gate every member until ``until`` (a timed site gate: a rate's spacing, a
    backoff), unless a timed gate already holds it longer."""
    gate = site.gate
    if gate is not None and gate.kind != SITE_GATE and gate.until >= until:
        return
    _shut(core, site, Gate(kind, until, setting, text))
    _due(core, site, until)


def site_settle(core: Core, site: Site) -> None:
    """After a member's delivery ended (``site.busy`` already counted down): a closed
    site that has room again opens."""
    if site.gate is not None and site.gate.kind == SITE_GATE and not site.full:
        _open(core, site)


def _close(core: Core, site: Site) -> None:
    _shut(core, site, Gate(SITE_GATE, math.inf, site.setting,
                           f"site {site.name} holds {site.busy} of {site.limit} sessions"))


def site_learnt(core: Core, domain: str, name: str, until: float) -> list[Queue]:
    """The driver found the domain's site: its queues move there, with what they
    have in flight (a site that fills closes, one that empties opens). Returns the
    queues that moved (the tenants' counts follow them, :mod:`.tenant_hold`)."""
    moved: list[Queue] = []
    table = core.sites
    if table is None:
        return moved
    domain = domain.lower()
    if domain in table.pinned:
        table.asked.discard(domain)
        return moved
    old = table.learn(domain, name, until)
    # The domain's queues are at the site named ``old`` in each transport with sites:
    # a look-up per transport, not a walk over every site.
    for transport in list(core.transports):
        site = table.sites.get((transport, old))
        if site is None:
            continue
        if old == name:
            _stop_waiting(core, site)
            continue
        limits = table.limits(transport)
        for queue in list(site.members):
            if queue.site is site and site_domain(queue.nexthop) == domain and limits:
                held = queue.gate is not None
                site_leave(core, queue)
                _join(core, queue, table.site(transport, name, limits))
                regate(core, queue)
                moved.append(queue)
                t = queue.transport
                if held and queue.gate is None and not t.broken:
                    # Its old site held it (a lookup's wait): its policy hears that it
                    # may deliver, as for any gate that opens.
                    t.policy.resumed(queue)
        if old == domain and not site.members and site.gate is not None \
                and site.gate.kind == LOOKUP_GATE:
            # The domain's own site, made only to hold it for this answer, and left
            # empty by it: it goes now, not at its wait's end (a new domain's site
            # came back at that tick to open, tell its policy and go: issue #44's
            # cost of a new domain).
            site.gate = None
            table.due.pop(site, None)
            _forget_if_neutral(core, site)
    return moved


# -- the site as a scope of its members' deliveries (:mod:`.scope`) -------------------


def _scope_started(core: Core, entry: Entry) -> None:
    site_started(core, entry.queue)


def _scope_unselected(core: Core, entry: Entry) -> bool:
    site = entry.queue.site
    assert site is not None
    site.busy -= 1
    return True


def _scope_ended(core: Core, entry: Entry, busy: bool) -> bool:
    site = entry.queue.site
    assert site is not None
    # Counted down now, or still for a moment (QUIT_GRACE): site_due settles it then.
    return busy and site_ended(core, site)


def _scope_settle(core: Core, entry: Entry) -> None:
    site = entry.queue.site
    if site is not None:  # else the queue left it meanwhile, and site_leave settled it
        site_settle(core, site)


SITE_KIND = ScopeKind("site", _scope_started, _scope_unselected, _scope_ended,
                       _scope_settle)
#: The chain of a queue at a site.
SITE_CHAIN = (SITE_KIND,)
