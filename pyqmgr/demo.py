"""``pyqmgr demo``: a sandboxed Postfix with pyqmgr as its qmgr, and real mail through it.

Starts a throwaway instance on loopback and a sink SMTP server playing a remote site,
sends a mixed batch (discard, smtp to the sink, local, an error destination that
bounces, and a sink recipient that answers 4xx and is deferred), waits for the dust
to settle and prints what happened to each message, read back from the maillog.
"""

from __future__ import annotations

import random
import time
from collections import Counter

from pyqmgr.testbed.instance import LOCAL_DOMAIN, LOCAL_USER, PostfixInstance, wait_until
from pyqmgr.testbed.sink import SinkServer


def run_demo(messages: int = 40, keep: bool = False) -> int:
    rng = random.Random(1)
    with SinkServer(replies={"busy@sink.example": "450 4.2.0 mailbox busy, try later"}) as sink:
        pf = PostfixInstance(
            qmgr="pyqmgr",
            transports={
                "discard.example": "discard:",
                "sink.example": f"smtp:[127.0.0.1]:{sink.port}",
                "nowhere.example": "error:5.1.2 no such domain",
            },
            main_cf={"recipient_delimiter": "+"},
        )
        try:
            pf.start()
            pid = pf.qmgr_pid()
            print(f"sandbox: {pf.root}")
            print(f"qmgr service: {pf.postconf('-M', 'qmgr/unix').split()[-1]} (pid {pid})")
            batch = []
            for i in range(messages):
                rcpts = [f"user{i}.{j}@{rng.choice(['discard.example', 'sink.example'])}"
                         for j in range(rng.randint(1, 5))]
                if i % 8 == 0:
                    rcpts.append(f"{LOCAL_USER}+demo{i}@{LOCAL_DOMAIN}")
                if i % 13 == 0:
                    rcpts.append(f"user{i}@nowhere.example")
                batch.append(("demo@discard.example", rcpts))
            batch.append(("demo@discard.example", ["busy@sink.example"]))
            t0 = time.monotonic()
            qids = pf.smtp_send(batch, subject="pyqmgr demo")
            print(f"sent {len(qids)} messages with "
                  f"{sum(len(r) for _, r in batch)} recipients over SMTP")

            def settled() -> bool:
                done = {ln.queue_id for ln in pf.maillog.lines("postfix/qmgr")
                        if ln.text.endswith(": removed")}
                return len(done & set(qids)) >= len(qids) - 1 and bool(
                    pf.queue_files("deferred"))

            wait_until(settled, 120, "the demo mail to be delivered or deferred")
            elapsed = time.monotonic() - t0
            _report(pf, qids, elapsed, sink)
        finally:
            if keep:
                pf.stop()
                print(f"kept sandbox at {pf.root}")
            else:
                pf.close()
    return 0


def _report(pf: PostfixInstance, qids: list[str], elapsed: float, sink: SinkServer) -> None:
    lines = pf.maillog.lines()
    statuses: Counter[tuple[str, str]] = Counter()
    for ln in lines:
        if ln.queue_id in qids and ln.status:
            statuses[(ln.program, ln.status)] += 1
    print(f"\nsettled in {elapsed:.2f} s; per-recipient results (from the maillog):")
    for (program, status), n in sorted(statuses.items()):
        print(f"  {program:16s} {status:9s} {n:5d}")
    qmgr = [ln for ln in lines if ln.program == "postfix/qmgr"]
    print(f"\nqmgr log lines: {sum('(queue active)' in ln.text for ln in qmgr)} queue active, "
          f"{sum(ln.text.endswith(': removed') for ln in qmgr)} removed "
          f"(bounce notices included), "
          f"{sum(ln.severity != 'info' for ln in qmgr)} warnings")
    print(f"sink received {sum(sink.stats.delivered.values())} recipients in "
          f"{sink.stats.sessions} SMTP sessions")
    deferred = pf.queue_files("deferred")
    print(f"deferred queue: {deferred} (the 4xx recipient waits for its retry time)")
    print("\nsample of the maillog:")
    sample = [ln.raw for ln in lines if ln.program == "postfix/qmgr"][:4]
    sample += [ln.raw for ln in lines if ln.status == "deferred"][:1]
    for raw in sample:
        print("  " + raw)
