"""Building a comparable :class:`Outcome` from a finished scenario run.

What counts: qmgr's own log lines in order (they are the scheduler's trace), every
delivery agent's and the bounce daemon's lines (sorted: agents run in parallel, so
their interleaving is not a property of the qmgr), the final queue counts, and the
notices that reached local mailboxes (subject, recipients and DSN fields). Queue ids,
pids, ports, paths and times are normalised away.
"""

from __future__ import annotations

import email
import email.policy
import os
import re
from collections.abc import Callable

from compat.harness import normalize
from compat.parity import Outcome
from pyqmgr.testbed.instance import LOCAL_USER, PostfixInstance

AGENTS = ("smtp", "local", "error", "retry", "discard", "bounce", "virtual", "pipe",
          "slow", "lmtp", "relay")

_PORT = re.compile(r"(\[127\.0\.0\.1\]):\d+")
_TMP = re.compile(r"/tmp/pyqmgr-tb-[A-Za-z0-9_]+")
_QID = re.compile(r"\b[0-9A-F]{10,12}\b")
#: How often an smtp connection was reused depends on timing, not on the qmgr; so does
#: Postfix 3.11's TLS feature status, logged (``tls=none``) for a new session and not for
#: a reused one. What qmgr passes that bears on TLS, the sendopts bits, is compared in
#: tests/test_requiretls.py from the request itself.
_CONN_USE = re.compile(r"conn_use=\d+, |tls=[^,]*, ")


def _clean(text: str) -> str:
    return _CONN_USE.sub("", _TMP.sub("<root>", _PORT.sub(r"\1:*", text)))


def log_lines(inst: PostfixInstance, qids: dict[str, str]) -> tuple[list[str], list[str]]:
    """(qmgr lines in order, agent and bounce lines sorted), normalised."""
    qmgr: list[str] = []
    agents: list[str] = []
    for ln in inst.maillog.lines():
        name = ln.program_name
        if name == "qmgr":
            qmgr.append(_clean(normalize(ln, qids)))
        elif name in AGENTS:
            agents.append(_clean(normalize(ln, qids)))
    return qmgr, sorted(agents)


def notices(inst: PostfixInstance, qids: dict[str, str], user: str = LOCAL_USER) -> list[str]:
    """Each message in a local mailbox: subject, To, and its DSN report fields."""
    path = inst.mailbox(user)
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        raw = f.read()
    out = []
    for chunk in re.split(rb"\n(?=From )", raw):
        if not chunk.strip():
            continue
        msg = email.message_from_bytes(chunk.partition(b"\n")[2], policy=email.policy.compat32)
        fields = [f"subject={msg.get('Subject', '')}", f"to={msg.get('To', '')}"]
        per_recipient: list[str] = []
        for part in msg.walk():
            if part.get_content_type() == "message/delivery-status":
                for sub in part.get_payload():
                    block = [f"{key}={sub.get(key)}"
                             for key in ("Final-Recipient", "Action", "Status",
                                         "Diagnostic-Code") if sub.get(key)]
                    if block:
                        per_recipient.append(" | ".join(block))
        # The per-recipient groups follow the bounce log's record order, which is the
        # order the delivery agents finished in: two agents for two queues race (seen in
        # CI: oqmgr's error:5.1.1 and relocated_maps' error:5.1.6 swapped places), so,
        # like the agents' log lines, they are compared as a set.
        text = " | ".join(fields + sorted(per_recipient))
        for qid in _QID.findall(text):
            qids.setdefault(qid, f"Q{len(qids) + 1}")
            text = text.replace(qid, qids[qid])
        out.append(_clean(text))
    return sorted(out)


def _grouped(lines: list[str]) -> list[str]:
    """Each file's lines together, files in name order, each file's own order kept.

    A line without a queue id (stock's "Unexpected record type") belongs to the file
    of the next line that has one: the reader logs it just before that file's verdict.
    """
    keys: list[str] = []
    for line in lines:
        m = re.search(r"\b(Q\d+|[A-Z0-9]{6,12})\b(?=[:\"])", line)
        keys.append(m.group(1) if m else "")
    nxt = "~"
    for i in range(len(lines) - 1, -1, -1):
        if keys[i]:
            nxt = keys[i]
        else:
            keys[i] = nxt
    order = sorted(range(len(lines)), key=lambda i: (keys[i], i))
    return [lines[i] for i in order]


def _once(lines: list[str]) -> list[str]:
    """Lines repeated one after another, once."""
    return [x for i, x in enumerate(lines) if i == 0 or lines[i - 1] != x]


def outcome(inst: PostfixInstance, unordered: bool = False, collapse: bool = False,
            grouped: bool = False, **extra: object) -> Outcome:
    """``unordered``: the order messages were picked up in is not comparable (it is a
    directory order, and the two runs have different queue ids), so ids are blanked
    and qmgr's lines sorted too. ``collapse``: how many periodic retries fit into the
    scenario's waits is timing, so repeated lines count once. ``grouped``: files
    dropped into a queue directory by hand are picked up in directory order, which is
    not the qmgr's choice; and a notice that bounce creates while its original
    completes may be picked up before or after the original's "removed" (stock's
    abounce_flush is asynchronous, and both orders were seen with either qmgr):
    compare each file's lines, files in name order."""
    qids: dict[str, str] = {}
    qmgr, agents = log_lines(inst, qids)
    if collapse:
        qmgr = _once(qmgr)
        agents = sorted(set(agents))
    if grouped:
        qmgr = _grouped(qmgr)
        if collapse:
            # A message's retries interleaved with another message's lines (its
            # notices) are next to each other once grouped: they too count once (the
            # Postfix 3.10 lane saw stock retry once more than pyqmgr within the waits).
            qmgr = _once(qmgr)
    if unordered:
        qmgr = sorted(re.sub(r"\bQ\d+\b", "Q", line) for line in qmgr)
        agents = sorted(re.sub(r"\bQ\d+\b", "Q", line) for line in agents)
    return Outcome(log=qmgr + ["--- agents ---"] + agents, queue=inst.queue_counts(),
                   notices=notices(inst, qids), extra=dict(extra))


def wait_log(inst: PostfixInstance, pred: Callable[..., bool], what: str,
             timeout: float = 30, count: int = 1) -> None:
    inst.maillog.wait_for(pred, timeout=timeout, count=count, what=what)


def settle(inst: PostfixInstance, seconds: float = 1.0) -> None:
    """Let trailing log lines (bounce, removal) arrive: wait until the log is quiet."""
    import time

    last = -1
    while True:
        n = len(inst.maillog.lines())
        if n == last:
            return
        last = n
        time.sleep(seconds)


#: Short retry timers, so that deferral scenarios finish within seconds.
FAST = {"queue_run_delay": "1s", "minimal_backoff_time": "2s", "maximal_backoff_time": "4s"}
#: Timers long enough that no queue run or retry happens during a scenario.
SLOW = {"queue_run_delay": "300s", "minimal_backoff_time": "300s",
        "maximal_backoff_time": "600s"}


def sink_config(srv, *domains: str, extra: dict[str, str] | None = None,
                **main: str) -> dict:
    """Instance settings: sink.example (and ``domains``) to the sink, FAST timers."""
    nexthop = f"smtp:[127.0.0.1]:{srv.port}"
    transports = {d: nexthop for d in ("sink.example", *domains)}
    transports.update(extra or {})
    return dict(transports=transports, main_cf={**FAST, **main})


def delivered(srv, since: int) -> list[str]:
    """Recipients the sink received after its first ``since`` messages, sorted."""
    return sorted(r for m in srv.messages()[since:] for r in m.recipients)


def wait_deferred(inst: PostfixInstance, qid: str) -> None:
    inst.wait_until(lambda: inst.queue_path("deferred", qid) is not None, 30,
                    f"{qid} in deferred/")


def postkick(inst: PostfixInstance, request: str, service: str = "qmgr") -> None:
    """Send a trigger the way postqueue and postsuper do.

    unix_trigger writes the request and then, separately, a NUL; stock's trigger
    server does one read and closes. When the read comes between the two writes (a
    loaded machine), postkick dies of SIGPIPE on the NUL although its request was
    taken. That death is accepted here; any other failure is not. A request that was
    really lost shows up as the scenario's next wait timing out.
    """
    import signal

    done = inst.run(["postkick", "-c", inst.config_dir, "public", service, request],
                    check=False, timeout=30)
    if done.returncode not in (0, -signal.SIGPIPE):
        raise AssertionError(f"postkick {service} {request} failed with status "
                             f"{done.returncode}: {done.stderr.strip()}")
