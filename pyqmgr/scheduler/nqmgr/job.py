"""A job: one message's work on one transport, and nqmgr's preemptive selection (``qmgr_job.c``).

Each transport keeps its jobs on two lists: the scheduler's job list, which preemption
reorders (a preempting job moves in front of the job it preempts), and the by-time
list in enqueue order, along which recipient slots are handed out. Selection takes
the current job, lets a better candidate preempt it when the current job has saved up
enough delivery slots (``delivery_slot_cost``, with ``delivery_slot_loan`` and
``delivery_slot_discount`` letting it happen early), then walks the job list from
there: jobs whose destinations are all at their concurrency limit are tagged as
blockers and skipped until one of those destinations frees up; jobs with nothing
in core are retired until they get more recipients.

The functions follow stock's one for one, so that the same events give the same
choices; the comments say why a step is there when stock's reason is not obvious.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler.entry import Entry, entry_select
from pyqmgr.scheduler.nqmgr.peer import peer_select
from pyqmgr.scheduler.nqmgr.segment import (
    Segments,
    segment_end,
    segment_key,
    segment_linked,
    segment_served,
    segment_unlinked,
)
from pyqmgr.scheduler.nqmgr.structures import Job, Peer
from pyqmgr.scheduler.nqmgr.structures import NqState as Transport
from pyqmgr.scheduler.qlist import Node

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message
    from pyqmgr.scheduler.policy import Context as Refiller
    from pyqmgr.scheduler.queue import Queue
    from pyqmgr.scheduler.structures import Site


def _cdiv(a: int, b: int) -> int:
    """C's integer division, which truncates toward zero (slot counts can go negative)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _next(node: Node[Job]) -> Job | None:
    return None if node.next is None else node.next.item


def reset_candidate_cache(transport: Transport) -> None:
    transport.candidate_cache_current = None


# -- life cycle -------------------------------------------------------------------------


def job_create(message: Message, transport: Transport) -> Job:
    job = Job(message, transport)
    message.jobs[transport.tname] = job
    return job


def job_link(job: Job) -> None:
    """Put a new or revived job on both lists, in enqueue-time order.

    Normally it goes at the end; a job revived by a later recipient batch, or created
    late for a multi-transport message, goes before younger jobs. Walking back from the
    end also tells whether it lands before the current job or the first job still
    reading recipients, and those pointers move to it.
    """
    t = job.transport
    message = job.message
    current = t.job_current
    prev = t.job_list.tail
    nxt: Node[Job] | None = None
    seg = t.segments
    key = (0, 0)
    if seg is None and (message.rank or message.tenant):
        # The first job of a lower class or with a tenant: every job before it was
        # in segment (0, 0), so the list's tail is that segment's.
        seg = t.segments = Segments()
        if prev is not None:
            segment_linked(seg, key, prev)
    if seg is not None:
        key = segment_key(seg, job)
        prev = segment_end(seg, key)
        nxt = t.job_list.head if prev is None else prev.next
        # A job of an earlier segment (a higher class, an earlier round) goes before
        # the current job, which it becomes: the next selection starts with it.
        if current is not None and (current.message.rank, current.round) > key:
            current = None
    while prev is not None:
        other = prev.item
        if other.round != job.round or other.message.rank != message.rank:
            break  # the end of the job's segment (never true without segments)
        # Test the parent, not the level: this keeps time order relative to orphaned
        # children after their level-zero parent is gone.
        if other.stack_parent is None and message.queued_time - other.message.queued_time >= 0:
            break
        if current is other:
            current = None
        nxt, prev = prev, prev.prev
    list_prev, list_next = prev, nxt

    unread = t.job_next_unread
    prev = t.job_bytime.tail
    nxt = None
    while prev is not None:
        if message.queued_time - prev.item.message.queued_time >= 0:
            break
        if unread is prev.item:
            unread = None
        nxt, prev = prev, prev.prev

    job.stack_level = 0
    t.job_list.link(list_prev, job.list_node, list_next)
    if seg is not None:
        segment_linked(seg, key, job.list_node)
    t.job_bytime.link(prev, job.time_node, nxt)
    if current is None:
        t.job_current = job
    # The first job still reading recipients gets the transport's spare slots; one
    # that used to be first gives back what it has not used.
    if unread is None:
        unread = t.job_next_unread
        t.job_next_unread = job
        if unread is not None:
            move_limits(unread)
    if t.rcpt_unused > 0:
        job.rcpt_limit += t.rcpt_unused
        message.rcpt_limit += t.rcpt_unused
        t.rcpt_unused = 0


def _list_unlink(t: Transport, job: Job) -> None:
    """Off the job list, its segment's tail moving back when it was that."""
    if t.segments is not None:
        segment_unlinked(t.segments, job)
    t.job_list.unlink(job.list_node)


def job_obtain(message: Message, transport: Transport) -> Job:
    """The message's job on this transport, created or relinked as needed.

    New recipients change the candidate estimates, and a blocker job may now have a
    deliverable entry; since other blockers may follow it, the current job pointer is
    reset to the head rather than patched.
    """
    job = message.jobs.get(transport.tname)
    if job is None:
        job = job_create(message, transport)
    if job.stack_level < 0:
        job_link(job)
    reset_candidate_cache(transport)
    if job.blocker_tag == transport.blocker_tag:
        job.blocker_tag = 0
        transport.job_current = transport.job_list.first()
    return job


def move_limits(job: Job) -> None:
    """Give the job's unused recipient slots back, to the next job still reading."""
    t = job.transport
    message = job.message
    nxt = t.job_next_unread
    if job is nxt:
        # The by-time order never changes, so this search is amortized O(1) per job.
        node = job.time_node.next
        while node is not None and not node.item.message.more:
            node = node.next
        nxt = None if node is None else node.item
        t.job_next_unread = nxt
    unused = min(job.rcpt_limit - job.rcpt_count, message.rcpt_limit - message.rcpt_count)
    if unused > 0:
        job.rcpt_limit -= unused
        message.rcpt_limit -= unused
        t.rcpt_unused += unused
        if nxt is not None and t.rcpt_unused > 0:
            spare = t.rcpt_unused
            nxt.rcpt_limit += spare
            nxt.message.rcpt_limit += spare
            t.rcpt_unused = 0


def _parent_gone(job: Job, parent: Job | None) -> None:
    """The job leaves the stack: its children go to its parent, or become orphans."""
    while job.children:
        child = job.children.first()
        assert child is not None
        job.children.unlink(child.sibling_node)
        if parent is not None:
            parent.children.append(child.sibling_node)
        child.stack_parent = parent


def job_unlink(job: Job) -> None:
    t = job.transport
    assert job.stack_level == 0, f"job_unlink: stack level {job.stack_level}"
    assert job.stack_parent is None and job.sibling_node.owner is None, "job_unlink: on a stack"
    _parent_gone(job, None)
    if t.job_current is job:
        t.job_current = _next(job.list_node)
    if job is t.candidate_cache or job is t.candidate_cache_current:
        reset_candidate_cache(t)
    _list_unlink(t, job)
    t.job_bytime.unlink(job.time_node)
    job.stack_level = -1


def job_retire(job: Job) -> None:
    """Off the lists until more recipients arrive; it stays on its message."""
    if job.stack_level > 0:
        job_pop(job)
    move_limits(job)
    job_unlink(job)


def job_free(job: Job) -> None:
    assert job.rcpt_count == 0, f"job_free: recipient count {job.rcpt_count}"
    if job.stack_level > 0:
        job_pop(job)
    move_limits(job)
    assert job.rcpt_limit == 0, f"job_free: recipient slots leak ({job.rcpt_limit})"
    if job.stack_level >= 0:
        job_unlink(job)
    del job.message.jobs[job.transport.tname]
    # No cycle left through its nodes (Entry.release says why).
    for node in (job.list_node, job.time_node, job.sibling_node):
        if node.owner is None:
            node.item = None  # type: ignore[assignment]


# -- preemption -------------------------------------------------------------------------


def _count_slots(job: Job) -> None:
    """One more delivery slot used by the job, and one more it may lend to others."""
    job.slots_available += 1
    job.slots_used += 1
    # A selection that is not the cached current job's makes that job a slightly
    # better candidate; the cache stays valid when the current job is selected.
    if job is not job.transport.candidate_cache_current:
        reset_candidate_cache(job.transport)


def _candidate(current: Job, now: int) -> Job | None:
    """The best job to preempt ``current``: largest (time in queue + 1) / entries.

    Only jobs that fit into the slots ``current`` can still accumulate count. The walk
    starts after ``current``, so its own stack children are never considered, and it
    stops early once no later level-zero job can beat the best score (jobs are in
    time order there). Negative results are cached too.
    """
    t = current.transport
    if t.candidate_cache_current is current and (
        t.candidate_cache_time == now or t.candidate_cache is None
    ):
        return t.candidate_cache
    max_slots = _cdiv(current.read_entries - current.selected_entries
                      + current.slots_available, t.slot_cost)
    best: Job | None = None
    best_score = 0.0
    if max_slots > 0:
        rank = current.message.rank
        rnd = current.round
        node = current.list_node.next
        while node is not None:
            job = node.item
            node = node.next
            # The hottest loop of the scheduler: Job.max_entries, Message.queued_time
            # and QList.__bool__ are spelt out here to save their calls.
            if job.children.head is not None or job.blocker_tag == t.blocker_tag:
                continue
            message = job.message
            if job.round != rnd or message.rank != rank:
                break  # only its own segment preempts a job (never without segments)
            max_total = job.read_entries + message.rcpt_unread
            max_needed = max_total - job.selected_entries
            delay = now - int(message.enqueue_time) + 1
            if 0 < max_needed <= max_slots:
                score = delay / max_total
                if score > best_score:
                    best_score = score
                    best = job
            if delay <= best_score and job.stack_level == 0:
                break
    t.candidate_cache = best
    t.candidate_cache_current = current
    t.candidate_cache_time = now
    return best


def _preempt(current: Job, now: int) -> Job:
    """Let the best candidate preempt ``current`` if enough slots (or a loan) allow."""
    t = current.transport
    if current.slots_available <= 0 or current.max_entries < t.min_slots * t.slot_cost:
        return current
    job = _candidate(current, now)
    if job is None:
        return current
    assert job is not current and not job.children and job.stack_level >= 0
    expected = job.max_entries - job.selected_entries
    # The loan lets preemption happen early; the slots are still paid in full later.
    if (current.slots_available // t.slot_cost + t.slot_loan
            < expected * t.slot_loan_factor / 100.0):
        return current
    if job.stack_level > 0:
        job_pop(job)
    _list_unlink(t, job)
    t.job_list.link(current.list_node.prev, job.list_node, current.list_node)
    job.stack_parent = current
    current.children.append(job.sibling_node)
    job.stack_level = current.stack_level + 1
    t.job_current = job
    t.transport.preemptions += 1  # the core transport outlives a policy instance
    reset_candidate_cache(t)
    # Charge the expected slots now, so that several preemptions do not spend the
    # same slots; slots_used then counts the difference, settled when it is popped.
    current.slots_available -= expected * t.slot_cost
    job.slots_used = -expected
    # A preempting job still reading recipients gets half of what is left of the
    # normal pool plus the per-stack extra pool.
    if job.message.more:
        rcpt_slots = _cdiv(t.rcpt_per_stack + t.rcpt_unused + 1, 2)
        job.rcpt_limit += rcpt_slots
        job.message.rcpt_limit += rcpt_slots
        t.rcpt_unused -= rcpt_slots
    return job


def job_pop(job: Job) -> None:
    """Back to level zero; the parent gets back the slots the job did not use.

    Only the original parent is credited (not an adoptive one), and its slots_used is
    left alone: both keep the per-message inflation factor bounded.
    """
    t = job.transport
    assert job.stack_level > 0, f"job_pop: not on the job stack ({job.stack_level})"
    parent = job.stack_parent
    if parent is not None and job.stack_level == parent.stack_level + 1:
        parent.slots_available -= job.slots_used * t.slot_cost
    if parent is not None:
        parent.children.unlink(job.sibling_node)
        job.stack_parent = None
    _parent_gone(job, parent)
    job.stack_level = 0
    reset_candidate_cache(t)


# -- selection --------------------------------------------------------------------------


def _job_peer_select(job: Job, ctx: Refiller) -> Peer | None:
    """A peer of the job with a deliverable entry, reading more recipients if due.

    Recipients are read as soon as enough slots are free (refill limit) or enough time
    has passed (refill delay), so one slow destination cannot starve the rest of a big
    message; and once more as a last resort when nothing in core is deliverable. Not
    while the message's completion is under way (refcount 0).
    """
    message = job.message
    t = job.transport
    if message.more and message.refcount > 0 and (
        message.rcpt_limit - message.rcpt_count >= t.refill_limit
        or (message.rcpt_limit > message.rcpt_count
            and ctx.clock - message.refill_time >= t.refill_delay)
    ):
        ctx.realloc(message)
    if job.has_entries:
        peer = peer_select(job)
        if peer is not None:
            return peer
    if message.more and message.refcount > 0 and message.rcpt_limit > message.rcpt_count:
        ctx.realloc(message)
        if job.has_entries:
            return peer_select(job)
    return None


def job_entry_select(t: Transport, ctx: Refiller) -> Entry | None:
    """The next entry an agent of this transport delivers (``qmgr_job_entry_select``)."""
    job = t.job_current
    if job is None:
        return None
    # Cost 1 makes preemption degenerate; stock turns it off below 2.
    if t.slot_cost >= 2:
        job = _preempt(job, ctx.clock)
    while job is not None:
        nxt = _next(job.list_node)
        if job.blocker_tag == t.blocker_tag:
            job = nxt
            continue
        peer = _job_peer_select(job, ctx)
        if peer is not None:
            entry = peer_entry_select(peer, ctx.clock)
            _count_slots(job)
            t.job_current = job
            if t.segments is not None:
                segment_served(t.segments, job)
            # All entries selected and nothing left to read: it cannot get more
            # without a new batch (which relinks it), so it leaves the lists now.
            if not job.has_entries and not job.message.more:
                job_retire(job)
            return entry
        if job.has_entries:
            # Every destination with entries is at its window: a blocker, together
            # with those queues, until one of them takes a delivery again.
            job.blocker_tag = t.blocker_tag
            for peer in job.peers:
                if peer.entries:
                    queue = peer.queue
                    queue.blocker_tag = t.blocker_tag
                    site = queue.site
                    if site is not None and site.gate is not None:
                        site.blocker_tag = t.blocker_tag
        else:
            job_retire(job)
        job = nxt
    t.job_current = None
    return None


def peer_entry_select(peer: Peer, now: int) -> Entry:
    """The peer's first entry goes busy (nqmgr's half of ``qmgr_entry_select``)."""
    entry = peer.entries.first()
    assert entry is not None
    peer.entries.unlink(entry.peer_node)
    peer.job.selected_entries += 1
    return entry_select(entry, now)


def site_unblock(t: Transport, site: Site) -> None:
    """A site that blocked some job opened: unblock all blockers at once (as
    :func:`blocker_update` does for a queue), without visiting the site's members."""
    if site.blocker_tag == t.blocker_tag:
        t.blocker_tag += 2
        t.job_current = t.job_list.first()
        t.candidate_cache_current = None
    site.blocker_tag = 0


def blocker_update(t: Transport, queue: Queue) -> None:
    """A blocking queue may take a delivery again: unblock all blockers at once.

    Bumping the transport's tag by 2 (it stays odd) clears every job's and queue's
    blocker status without visiting them; selection re-finds the real current job.
    """
    if queue.blocker_tag == t.blocker_tag:
        # A gated queue (suspended, rate-spaced) stays a blocker until its gate opens
        # (the opening calls this again through Policy.resumed).
        open_ = queue.window > queue.busy_count and queue.gate is None
        if open_ and queue.todo:
            t.blocker_tag += 2
            t.job_current = t.job_list.first()
            t.candidate_cache_current = None
        if open_ or queue.throttled:
            queue.blocker_tag = 0
