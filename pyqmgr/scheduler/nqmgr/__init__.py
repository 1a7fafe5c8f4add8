"""nqmgr: stock Postfix's queue manager scheduler, the default policy.

Per transport, the preemptive job scheduler (:mod:`.job`): one job per message and
transport, peers per job and destination (:mod:`.peer`), a job list that preemption
reorders, blocker jobs, and the recipient slot pools that decide how many recipients
of a message are read into core. Everything here follows stock's ``qmgr_job.c``,
``qmgr_peer.c`` and the nqmgr halves of ``qmgr_entry.c`` and ``qmgr_message.c``, so
that the same events give the same choices as stock qmgr; the parity suite holds it
to that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from pyqmgr.scheduler.entry import Entry, entry_link
from pyqmgr.scheduler.nqmgr.job import (
    Job,
    _cdiv,
    blocker_update,
    job_entry_select,
    job_free,
    job_obtain,
    move_limits,
    site_unblock,
)
from pyqmgr.scheduler.nqmgr.peer import peer_free, peer_obtain
from pyqmgr.scheduler.nqmgr.structures import NqEntry, NqState, Peer
from pyqmgr.scheduler.policy import Context, Reason, reason

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message, Recipient
    from pyqmgr.scheduler.queue import Queue
    from pyqmgr.scheduler.structures import Site
    from pyqmgr.scheduler.transport import Transport


#: Jobs explain's turn walks at most (50-85 ms for 10,000 jobs in a reply's turn).
TURN_WALK = 20_000


class Nqmgr(NqState):
    """One transport's nqmgr state: its job lists, candidate cache and slot pools."""

    name = "nqmgr"
    holds_slots = True

    def __init__(self, transport: Transport, ctx: Context) -> None:
        NqState.__init__(self, transport, ctx)

    # -- recipients in ------------------------------------------------------------------

    def add(self, message: Message, queue: Queue, recipient: Recipient,
            last: Entry | None) -> Entry:
        """``qmgr_message_assign``'s step: the message's job, its peer, the last entry.

        The last entry of the peer is filled up to the recipient limit, even one made
        by an earlier batch, so that refills do not fragment delivery requests.
        """
        if last is not None:
            peer = cast(NqEntry, last).peer
            job = peer.job
        else:
            job = job_obtain(message, self)
            peer = peer_obtain(job, queue)
        limit = self.transport.recipient_limit
        entry = peer.entries.last()
        if message.single_rcpt or entry is None or (
                limit != 0 and len(entry.recipients) >= limit):
            entry = self._entry_create(message, queue, peer)
        entry.recipients.append(recipient)
        job.rcpt_count += 1
        return entry

    def new_entry(self, message: Message, queue: Queue) -> Entry:
        return self._entry_create(message, queue, peer_obtain(job_obtain(message, self), queue))

    def _entry_create(self, message: Message, queue: Queue, peer: Peer) -> NqEntry:
        entry = NqEntry(message, queue, peer)
        peer.entries.append(entry.peer_node)
        peer.refcount += 1
        peer.job.read_entries += 1
        entry_link(entry)
        return entry

    def moved(self, entry: Entry, count: int) -> None:
        cast(NqEntry, entry).peer.job.rcpt_count += count

    @classmethod
    def message_assigned(cls, message: Message) -> None:
        """Jobs of this message that got nothing new still changed estimates."""
        for other in message.jobs.values():
            t = other.transport
            if other.has_entries and other.blocker_tag != t.blocker_tag:
                t.candidate_cache_current = None
        if not message.more:
            for other in list(message.jobs.values()):
                move_limits(other)

    # -- deliveries -------------------------------------------------------------------

    def select(self) -> Entry | None:
        return job_entry_select(self, self.ctx)

    def unselect(self, entry: Entry) -> None:
        """Back at the head of the peer's list: select/unselect must not reorder."""
        nq = cast(NqEntry, entry)
        nq.peer.entries.prepend(nq.peer_node)
        nq.peer.job.selected_entries -= 1

    def todo_entries(self, message: Message) -> list[Entry]:
        """The message's todo entries here, through its job's peers (no walk)."""
        job = message.jobs.get(self.tname)
        if job is None:
            return []
        return [e for peer in list(job.peers) for e in peer.entries if not e.busy]

    def requeued(self, entry: Entry) -> None:
        """An unselected entry stays todo for a while (a policy service's DEFER).

        Stock only unselects right before the whole transport is deferred, so a job
        whose last entry was selected is retired and nothing relinks it; an entry that
        waits in todo needs its job back on the lists (and its caches reset), as a new
        recipient batch would do.
        """
        job_obtain(entry.message, self)

    def done(self, entry: Entry, busy: bool) -> None:
        nq = cast(NqEntry, entry)
        peer = nq.peer
        job = peer.job
        message = entry.message
        queue = entry.queue
        if not busy:
            peer.entries.unlink(nq.peer_node)
            job.selected_entries += 1
        job.rcpt_count -= len(entry.recipients)
        # Jobs that sponsored this message's slots get them back first; then the rest
        # goes on to the next job still reading.
        for sponsor in list(message.jobs.values()):
            if sponsor.rcpt_count >= sponsor.rcpt_limit or sponsor is job:
                continue
            if sponsor.stack_level < 0 or not message.more:
                move_limits(sponsor)
        if not message.more:
            move_limits(job)
        # A rate-delayed (suspended) queue postpones the decision until it resumes.
        if not queue.paused and queue.blocker_tag == self.blocker_tag:
            blocker_update(self, queue)
        peer.refcount -= 1
        if peer.refcount == 0:
            peer_free(peer)

    @classmethod
    def message_done(cls, message: Message) -> None:
        if not message.more:
            for job in list(message.jobs.values()):
                job_free(job)

    def resumed(self, queue: Queue) -> None:
        blocker_update(self, queue)

    def site_opened(self, site: Site) -> None:
        site_unblock(self, site)

    def describe(self) -> dict[str, object]:
        current = self.job_current
        return {"policy": self.name, "jobs": len(self.job_list),
                "current_job": current.message.queue_id if current is not None else None}

    def jobs_report(self, now: float, limit: int | None = None) -> dict[str, object]:
        """The job list in scheduler order, with each job's slots, loan and stack place.

        Slots: a job earns one delivery slot per entry it delivers
        (``slots_available``); ``delivery_slot_cost`` of them let a job that needs
        one entry preempt it, ``delivery_slot_loan`` (and ``delivery_slot_discount``)
        let preemption happen before they are saved up. A preemption charges the
        preempted job the preempting job's expected entries at once, so a negative
        ``slots_available`` is a loan it has yet to earn back; ``preempt_for`` is the
        most entries a job may need and still preempt this one now (0: it cannot be
        preempted now). The preemption stack is each job's ``preempts`` (its
        ``stack_parent``) and ``preempted_by`` (its children), and ``stacks`` lists
        every chain from a preempted job at level 0 up to the job on top.
        """
        t = self.tname
        current = self.job_current
        rows: list[dict[str, object]] = []
        stacks: list[list[str]] = []
        for pos, job in enumerate(self.job_list, 1):
            if job.stack_parent is None and job.children:
                stacks += _chains(job, [])
            if limit is not None and pos > limit:
                continue
            message = job.message
            rows.append({
                "queue_id": message.queue_id,
                "position": pos,
                "current": job is current,
                "stack_level": job.stack_level,
                "preempts": (job.stack_parent.message.queue_id
                             if job.stack_parent is not None else None),
                "preempted_by": [c.message.queue_id for c in job.children],
                "blocker": job.blocker_tag == self.blocker_tag,
                "slots_used": job.slots_used,
                "slots_available": job.slots_available,
                "loan": max(0, -job.slots_available),
                "preempt_for": self._preempt_for(job),
                "entries_selected": job.selected_entries,
                "entries_read": job.read_entries,
                "entries_max": job.max_entries,
                "recipients": job.rcpt_count,
                "recipient_limit": job.rcpt_limit,
                "recipients_unread": message.rcpt_unread,
                "reading": message.more,
                "age": round(now - message.enqueue_time, 3),
                # Its segment (classes and tenants, issue #34); absent as in stock.
                **({"class_rank": message.rank, "tenant": message.tenant,
                    "round": job.round} if self.segments is not None else {}),
                # In the job's round-robin order: the first peer with room goes next.
                "destinations": [{"destination": peer.queue.name,
                                  "todo": len(peer.entries),
                                  "in_flight": peer.refcount - len(peer.entries)}
                                 for peer in job.peers],
            })
        return {
            "policy": self.name, "kind": "jobs",
            "order": "the job list as the scheduler walks it: a preempting job stands "
                     "right before the job it preempted; the walk starts at the current "
                     "job and skips blockers",
            "settings": {f"{t}_delivery_slot_cost": self.slot_cost,
                         f"{t}_delivery_slot_loan": self.slot_loan,
                         f"{t}_delivery_slot_discount": 100 - self.slot_loan_factor,
                         f"{t}_minimum_delivery_slots": self.min_slots},
            "preemption": self.slot_cost >= 2,
            "current_job": current.message.queue_id if current is not None else None,
            "next_unread": (self.job_next_unread.message.queue_id
                            if self.job_next_unread is not None else None),
            "spare_recipient_slots": self.rcpt_unused,
            "stacks": stacks,
            "total": len(self.job_list),
            "jobs": rows,
        }

    def _turn(self, job: Job) -> Reason:
        """Where the job waits in the segments (classes, tenants' rounds): the jobs
        of higher classes and of its class's earlier rounds before it. A walk from
        the head, for explain only (at most :data:`TURN_WALK` jobs)."""
        message = job.message
        names = self.ctx.class_names
        rank = message.rank
        name = names[rank] if rank < len(names) else f"rank {rank}"
        higher = earlier = 0
        node = self.job_list.head
        for _ in range(TURN_WALK):
            if node is None or node.item is job:
                break
            other = node.item
            if other.message.rank < rank:
                higher += 1
            elif other.round < job.round:
                earlier += 1
            node = node.next
        tenant = (f", tenant {message.tenant} in round {job.round}" if message.tenant
                  else "")
        return reason(
            "class and tenant turn", "message_classes" if len(names) > 1 else "tenant_key",
            f"{message.queue_id} is of class {name}{tenant}: {higher} jobs of higher "
            f"classes and {earlier} of its class's earlier rounds go before it",
            message_class=name, tenant=message.tenant, round=job.round,
            ahead_higher_classes=higher, ahead_earlier_rounds=earlier)

    def _preempt_for(self, job: Job) -> int:
        """The most entries a job may still need to preempt ``job`` now (``_preempt``'s
        test turned around); 0 when ``job`` cannot be preempted now."""
        if (self.slot_cost < 2 or job.slots_available <= 0
                or job.max_entries < self.min_slots * self.slot_cost):
            return 0
        # A candidate must fit into the slots the job can still accumulate...
        fits = _cdiv(job.read_entries - job.selected_entries + job.slots_available,
                     self.slot_cost)
        if fits <= 0 or self.slot_loan_factor <= 0:
            return max(fits, 0)
        # ...and its expected entries, discounted, into the saved slots plus the loan.
        budget = job.slots_available // self.slot_cost + self.slot_loan
        return min(fits, budget * 100 // self.slot_loan_factor)

    def explain(self, queue: Queue | None, message: Message | None) -> list[Reason]:
        """Blocker jobs and preemption: nqmgr's own reasons for waiting."""
        t = self.tname
        out: list[Reason] = []
        if message is None:
            if queue is not None and queue.blocker_tag == self.blocker_tag:
                out.append(reason(
                    "blocker job", f"{t}_destination_concurrency_limit",
                    f"jobs with mail for {queue.nexthop} are blockers: every destination "
                    "they have mail for is at its window or held back, so they are skipped "
                    "until one takes a delivery again"))
            return out
        job = message.jobs.get(t)
        if job is None:
            return out
        if self.segments is not None and job.stack_level >= 0 and job is not self.job_current:
            out.append(self._turn(job))
        if job.blocker_tag == self.blocker_tag:
            out.append(reason(
                "blocker job", f"{t}_destination_concurrency_limit",
                f"the job of {message.queue_id} on {t} is a blocker: every destination "
                "it has mail for is at its window or held back"))
        if job.children and self.job_current is not job:
            child = job.children.first()
            assert child is not None
            out.append(reason(
                "preempted", f"{t}_delivery_slot_cost",
                f"the job of {message.queue_id} on {t} is preempted by the job of "
                f"{child.message.queue_id}, which needs fewer delivery slots; it resumes "
                "when that one is done", preempted_by=child.message.queue_id))
        return out


def _chains(job: Job, below: list[str]) -> list[list[str]]:
    """Every preemption chain from ``job`` up: [preempted, ..., job on top]."""
    path = [*below, job.message.queue_id]
    if not job.children:
        return [path]
    return [chain for child in job.children for chain in _chains(child, path)]
