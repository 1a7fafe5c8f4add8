"""Priority benchmark (issue #34): password resets beside a 50,000-message newsletter.

Each contender gets a fresh instance with 50,000 newsletter messages (from
news@letters.example, copies of real queue files: ``clone_queue_files``) queued in
incoming/ before its qmgr starts, for five destinations whose SMTP sinks answer every
recipient after 20 ms. Once 2,000 have gone out the measurement runs eleven phases
of 2.2 s (both contenders deliver 1,200-1,800 a second here: the backlog must last
them): in the second, fourth and every other one, password resets (from
resets@shop.example, to the same five destinations) arrive by SMTP at 5 a second; in
the others, none. Each phase with resets is set against the mean of the two without
around it, so that the newsletter's own drift (its backlog shrinking, the active
queue filling) cancels.

Printed for each contender: the resets' delays (SMTP submission to the sink's
acceptance: p50, p95, max) and the newsletter's deliveries a second in the phases with
and without resets. pyqmgr runs with pyqmgr.cf naming two classes and shop.example's
mail transactional (docs/priority.md); stock has no classes. Targets (issue #34):
pyqmgr's p95 under 1 s, and its newsletter rate with resets at least 95% of without.
"""

from __future__ import annotations

import argparse
import smtplib
import statistics
import threading
import time
from dataclasses import dataclass, field
from email.message import EmailMessage

from benchmarks.target import Target, status
from pyqmgr.testbed.instance import PostfixInstance, wait_until
from pyqmgr.testbed.sink import SinkServer

BULK = 50_000
DESTINATIONS = 5
LATENCY = 0.02
WARM = 2_000
PHASES = 11
PHASE = 2.2
RATE = 5.0
TEMPLATES = 500
CLASSES_CF = {"message_classes": "transactional bulk",
              "message_class_maps": "inline:{ shop.example=transactional }"}

P95 = Target("pyqmgr with classes: the resets' p95 delay under 1 s")
THROUGHPUT = Target("pyqmgr with classes: newsletter rate with resets >= 95% of without")


@dataclass
class Result:
    delays: list[float]
    #: Newsletter deliveries a second, phases without resets and with.
    rate_off: float
    rate_on: float
    never: int = 0
    phases: list[tuple[bool, int]] = field(default_factory=list)

    def line(self, name: str) -> str:
        d = sorted(self.delays)
        p95 = d[max(0, round(0.95 * len(d)) - 1)] if d else float("nan")
        return (f"{name:22s} resets: {len(d)} delivered, p50 {statistics.median(d):.2f} s, "
                f"p95 {p95:.2f} s, max {d[-1]:.2f} s; newsletter {self.rate_off:.1f}/s "
                f"without resets, {self.rate_on:.1f}/s with "
                f"({self.rate_on / self.rate_off:.3f})")

    @property
    def p95(self) -> float:
        d = sorted(self.delays)
        return d[max(0, round(0.95 * len(d)) - 1)]


def _templates() -> list[bytes]:
    """Newsletter queue files as a real smtpd and cleanup wrote them."""
    with PostfixInstance(qmgr="stock", transports={"discard.example": "discard:"}) as pf:
        pf.start()
        pf.preload([("news@letters.example", [f"n{i}@d{i % DESTINATIONS}.example"])
                    for i in range(TEMPLATES)])
        files = pf.queue_file_bytes("incoming")
    if len(files) != TEMPLATES:
        raise RuntimeError(f"{len(files)} template files for {TEMPLATES} messages")
    return files


class Resets(threading.Thread):
    """Sends one reset every 1/RATE s during the 'on' phases; records send times."""

    def __init__(self, port: int, start_at: float) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.start_at = start_at
        self.sent: dict[str, float] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with smtplib.SMTP("127.0.0.1", self.port, timeout=60) as smtp:
                smtp.ehlo()
                k = 0
                for phase in range(PHASES):
                    if phase % 2 == 0:
                        continue
                    begin = self.start_at + phase * PHASE
                    for i in range(int(PHASE * RATE)):
                        at = begin + i / RATE
                        time.sleep(max(0.0, at - time.time()))
                        rcpt = f"reset{k}@d{k % DESTINATIONS}.example"
                        msg = EmailMessage()
                        msg["From"] = "resets@shop.example"
                        msg["To"] = rcpt
                        msg["Subject"] = "your password reset"
                        msg.set_content(f"reset {k}\n")
                        self.sent[rcpt] = time.time()
                        smtp.send_message(msg, "resets@shop.example", [rcpt])
                        k += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc


def run_once(qmgr: str, templates: list[bytes], pyqmgr_cf: dict[str, str] | None
             ) -> Result:
    sinks = [SinkServer(latency=LATENCY).start() for _ in range(DESTINATIONS)]
    try:
        transports = {f"d{i}.example": f"smtp:[127.0.0.1]:{s.port}"
                      for i, s in enumerate(sinks)}
        with PostfixInstance(qmgr=qmgr, transports=transports, pyqmgr_cf=pyqmgr_cf) as pf:
            pf.start()
            pf.disable_qmgr()
            pf.clone_queue_files(templates, BULK)
            pf.release_preload()

            def delivered() -> int:
                return sum(s.delivered_count() for s in sinks)

            wait_until(lambda: delivered() >= WARM, 300,
                       f"{WARM} newsletter messages delivered by {qmgr}", interval=0.05)
            start_at = time.time() + 0.5
            resets = Resets(pf.smtpd_port, start_at)
            resets.start()
            end = start_at + PHASES * PHASE
            time.sleep(max(0.0, end - time.time()))
            resets.join(120)
            if resets.error is not None:
                raise RuntimeError(f"{qmgr}: sending resets: {resets.error!r}")
            sent = resets.sent

            def arrived() -> bool:
                # The messages, not the RCPT outcomes: those come before DATA ends.
                got = {m.recipients[0] for s in sinks for m in s.messages()}
                return all(r in got for r in sent)

            wait_until(arrived, 600, f"every reset delivered by {qmgr}", interval=0.2)
            got: dict[str, float] = {}
            per_phase = [0] * PHASES
            for s in sinks:
                for m in s.messages():
                    rcpt = m.recipients[0]
                    if rcpt in sent:
                        got[rcpt] = m.time
                    elif start_at <= m.time < end:
                        per_phase[int((m.time - start_at) // PHASE)] += 1
        on_phases = range(1, PHASES - 1, 2)
        on = sum(per_phase[i] for i in on_phases)
        off = sum((per_phase[i - 1] + per_phase[i + 1]) / 2 for i in on_phases)
        span = PHASE * len(on_phases)
        return Result([got[r] - sent[r] for r in sent], off / span, on / span,
                      phases=[(i % 2 == 1, n) for i, n in enumerate(per_phase)])
    finally:
        for s in sinks:
            s.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev bench priority", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3,
                        help="pyqmgr's runs (default 3): the targets take every run's "
                             "resets together and the median of the runs' rate ratios")
    parser.add_argument("--no-stock", action="store_true",
                        help="pyqmgr only (stock's one run is the comparison)")
    args = parser.parse_args(argv)
    templates = _templates()
    mine: list[Result] = []
    contenders = [("pyqmgr", CLASSES_CF)] * args.rounds + (
        [] if args.no_stock else [("stock", None)])
    for qmgr, cf in contenders:
        started = time.monotonic()
        res = run_once(qmgr, templates, cf)
        if cf is not None:
            mine.append(res)
        print(res.line(qmgr + (" (classes)" if cf else "")) +
              f"; phases {res.phases}; {time.monotonic() - started:.0f} s", flush=True)
    pooled = Result([d for r in mine for d in r.delays], 0, 0)
    ratio = statistics.median(r.rate_on / r.rate_off for r in mine)
    print(f"pyqmgr, {len(mine)} runs: resets p95 {pooled.p95:.2f} s of {len(pooled.delays)}; "
          f"newsletter rate with resets / without, median {ratio:.3f}", flush=True)
    return status([P95.check(pooled.p95 < 1.0, f"{pooled.p95:.2f} s"),
                   THROUGHPUT.check(ratio >= 0.95, f"median {ratio:.3f}")])


if __name__ == "__main__":
    raise SystemExit(main())
