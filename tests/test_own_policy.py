"""A scheduling policy of one's own (``scheduler_policy = module:PATH``), end to end.

docs/policies.md's tutorial promises three things, and real Postfix checks each: the example
in contrib/ delivers everything once; a policy that raises loses nothing (its
transport's mail is deferred and goes out once the policy is fixed); and a bad
pyqmgr.cf value stops the daemon with a fatal line naming the file and the parameter
while the mail waits in the queue. The first tests drive the scheduler core alone:
the example keeps a one-recipient message from waiting behind a list, and its
bookkeeping holds under random traffic with failures.

Policy files live in the test bed's config directory (root's, 0755 all the way up),
written by the tests with mode 0644, as the trust check demands.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from collections import deque
from typing import Any

import pytest

from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.entry import Entry
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.policy import PolicyTable
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.settings.policies import load
from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.maillog import LogLine
from pyqmgr.testbed.sink import SinkServer
from tests.unit.params import Params

CONTRIB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "contrib")
SENDER_CLASSES = os.path.join(CONTRIB, "sender_classes.py")

#: A policy that serves the first three selections (oldest entry of the first
#: destination with room) and raises from then on. The count is per module, not per
#: instance, so the fresh policy the transport gets when it revives raises too.
RAISING_POLICY = '''\
from pyqmgr.scheduler.entry import entry_select
from pyqmgr.scheduler.policy import Policy

SELECTIONS = [0]


class Raising(Policy):
    name = "raising"

    def select(self):
        SELECTIONS[0] += 1
        if SELECTIONS[0] > 3:
            raise RuntimeError(f"selection {SELECTIONS[0]} refused on purpose")
        for queue in list(self.transport.queues.values()):
            if self.transport.room(queue) > 0 and queue.todo:
                return entry_select(queue.todo.first(), self.ctx.clock)
        return None
'''


def install_policy(pf: PostfixInstance, name: str, text: str) -> str:
    """Write a policy file into the instance's config directory (root's, 0644)."""
    path = os.path.join(pf.config_dir, name)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o644)
    return path


def qmgr_problems(pf: PostfixInstance) -> list[str]:
    return [ln.text for ln in pf.maillog.lines(program="postfix/qmgr")
            if ln.severity in ("warning", "error", "fatal", "panic")]


# -- the scheduler core alone ----------------------------------------------------------


def _scheduler(policy: str, **params: Any) -> Scheduler:
    table = PolicyTable(load(policy), setting=lambda name, transport, default: default)
    return Scheduler(lambda name: Params(**params), policies=table)


def _selections_until_small(policy: str, same_destination: bool) -> int:
    """A 300-recipient list fills 10 agents; then one small message arrives.

    Each step one delivery ends and one agent asks for work; the answer is how many
    agents were handed out before one took the small message.
    """
    s = _scheduler(policy, destination_recipient_limit=1, initial_destination_concurrency=10)
    big = Message("LIST", 0.0)
    s.assign(big, [Route("smtp", "same.example" if same_destination else f"d{i}.example",
                         "x", Recipient(i, f"u{i}@x")) for i in range(300)])
    inflight: deque[Entry] = deque()
    for _ in range(10):
        entry = s.select("smtp").deliver
        assert entry is not None
        inflight.append(entry)
    small = Message("SMALL", 1.0)
    s.assign(small, [Route("smtp", "same.example" if same_destination else "small.example",
                           "x", Recipient(0, "a@small.example"))])
    now = 2.0
    for n in range(1, 400):
        s.done(inflight.popleft(), 0, None, False, now)
        now += 0.01
        entry = s.select("smtp", now).deliver
        assert entry is not None
        if entry.message is small:
            return n
        inflight.append(entry)
    raise AssertionError(f"{policy}: the small message was not chosen in 400 selections")


@pytest.mark.parametrize("same_destination", [False, True])
def test_sender_classes_serves_a_small_message_before_the_list(same_destination):
    """oqmgr's round robin makes the small message wait ~300 agents; sender classes ~1.

    With the default weights 4:2:1 the small class waits at most for the credit the
    current class has left: two agents (medium's weight).
    """
    mine = _selections_until_small("module:" + SENDER_CLASSES, same_destination)
    oqmgr = _selections_until_small("oqmgr", same_destination)
    assert mine <= 3, f"sender_classes: small message chosen after {mine} agents"
    assert oqmgr > 250, f"oqmgr was expected to starve it, chose it after {oqmgr}"


def _random_traffic(seed: int) -> None:
    rng = random.Random(seed)
    s = _scheduler("module:" + SENDER_CLASSES, destination_recipient_limit=rng.choice([1, 3]),
                   initial_destination_concurrency=2, destination_concurrency_limit=4)
    inflight: list[Entry] = []
    log: list[tuple[str, str]] = []
    now = 0.0
    for step in range(2000):
        now += 0.1
        r = rng.random()
        if r < 0.05:
            n = rng.choice([1, 1, 2, 5, 20, 150])
            routes = sorted((Route("smtp", f"d{rng.randrange(8)}", "x", Recipient(i, f"u{i}"))
                             for i in range(n)), key=lambda route: route.queue_name)
            log += s.assign(Message(f"M{step}", now), routes, now=now).log
        elif r < 0.6 and len(inflight) < 10:
            d = s.select("smtp", now)
            log += d.log
            entry = d.deliver
            t = s.transport("smtp")
            assert entry is not None or t.broken or not t.ready_queues, (
                f"seed {seed} step {step}: destinations have room and work, none chosen")
            if entry is not None:
                inflight.append(entry)
        elif inflight:
            entry = inflight.pop(rng.randrange(len(inflight)))
            if rng.random() < 0.05:
                log += s.done(entry, 1, Dsn("4.4.1", "connection refused"), False, now).log
            else:
                log += s.done(entry, 0, None, False, now).log
        log += s.tick(now).log
        if "smtp" in s.transports:
            t = s.transports["smtp"]
            policy = t.policy
            for message, job in policy.jobs.items():  # type: ignore[attr-defined]
                in_core = sum(len(e.recipients) for q in t.queues.values()
                              for e in [*q.todo, *(x for x in inflight if x.queue is q)]
                              if e.message is message)
                assert job.rcpts == in_core, f"seed {seed} step {step}: backlog count"
    assert not [text for _, text in log if "scheduler policy" in text], log
    # Drain: everything left is delivered, and the policy forgets every message.
    while inflight or any(q.todo for q in s.transports["smtp"].queues.values()):
        now += 400  # past any dead destination's backoff
        s.tick(now)
        while (entry := s.select("smtp", now).deliver) is not None:
            inflight.append(entry)
        while inflight:
            s.done(inflight.pop(), 0, None, False, now)
    policy = s.transports["smtp"].policy
    assert not policy.jobs and not policy.parked  # type: ignore[attr-defined]


@pytest.mark.parametrize("seed", range(6))
def test_sender_classes_bookkeeping_under_random_traffic(seed):
    _random_traffic(seed)


def test_the_readme_example_policy_runs(tmp_path):
    """The 20-line example in docs/policies.md loads and serves the oldest message first."""
    with open(os.path.join(os.path.dirname(CONTRIB), "docs", "policies.md")) as f:
        readme = f.read()
    section = readme[readme.index("## Your own scheduling policy"):]
    code = section[section.index("```python\n") + 10:]
    code = code[:code.index("```")]
    path = tmp_path / "oldest_first.py"
    path.write_text(code)
    s = _scheduler(f"module:{path}", destination_recipient_limit=1,
                   initial_destination_concurrency=1)
    assert s.policy("smtp").name == "oldest_first"
    young, old = Message("YOUNG", 20.0), Message("OLD", 10.0)
    s.assign(young, [Route("smtp", "a.example", "x", Recipient(0, "y@a.example"))])
    s.assign(old, [Route("smtp", "b.example", "x", Recipient(i, f"o{i}@b.example"))
                   for i in range(2)])
    first, second = s.select("smtp").deliver, s.select("smtp").deliver
    assert first is not None and first.message is old
    assert second is not None and second.message is young, "b.example is at its window"
    assert s.select("smtp").deliver is None
    s.done(first, 0, None, False, 1.0)
    third = s.select("smtp", 1.0).deliver
    assert third is not None and third.message is old


# -- real Postfix ----------------------------------------------------------------------


def test_contrib_sender_classes_delivers_everything_once(postfix_instance, sink):
    srv: SinkServer = sink(latency=0.01)
    nexthop = f"smtp:[127.0.0.1]:{srv.port}"
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", start=False, transports={f"d{i}.example": nexthop for i in range(3)})
    path = os.path.join(pf.config_dir, "sender_classes.py")
    shutil.copyfile(SENDER_CLASSES, path)
    os.chmod(path, 0o644)
    pf.write_pyqmgr_cf({"scheduler_policy": f"module:{path}"})
    pf.start()
    # A list (large: 150 recipients), a medium message and twenty one-recipient ones.
    msgs = [("list@test.example", [f"l{i}@d{i % 3}.example" for i in range(150)]),
            ("medium@test.example", [f"m{i}@d{i % 3}.example" for i in range(30)])]
    msgs += [(f"s{i}@test.example", [f"s{i}@d{i % 3}.example"]) for i in range(20)]
    want = sum(len(r) for _, r in msgs)
    qids = pf.smtp_send(msgs)
    pf.wait_until(lambda: sum(len(m.recipients) for m in srv.messages()) >= want, 60,
                  f"{want} recipients at the sink")
    pf.wait_queue_empty(30)
    got = [r for m in srv.messages() for r in m.recipients]
    assert len(got) == len(set(got)) == want, "every recipient exactly once"
    pf.wait_removed(qids)
    assert not qmgr_problems(pf)


def test_a_raising_policy_defers_and_loses_nothing(postfix_instance, sink):
    srv: SinkServer = sink(latency=0.01)
    nexthop = f"smtp:[127.0.0.1]:{srv.port}"
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", start=False, transports={"d.example": nexthop})
    path = install_policy(pf, "raising_policy.py", RAISING_POLICY)
    pf.write_pyqmgr_cf({"scheduler_policy": f"module:{path}"})
    pf.start()
    n = 10
    qids = pf.smtp_send([("s@test.example", [f"r{i}@d.example"]) for i in range(n)])
    warning = pf.maillog.wait_for(
        lambda ln: ln.program_name == "qmgr" and "scheduler policy raising: select:" in ln.text,
        timeout=30, what="the qmgr warning that names the raising policy")[0]
    assert warning.severity == "warning"
    assert warning.text == ("warning: transport smtp: scheduler policy raising: select: "
                            "RuntimeError: selection 4 refused on purpose")
    # Three selections were served; everything else goes to the retry transport.
    pf.wait_until(lambda: len(pf.queue_files("deferred")) == n - 3
                  and not pf.queue_files("incoming") and not pf.queue_files("active"),
                  30, f"{n - 3} files in deferred/ and none in incoming/ or active/")
    pf.wait_until(lambda: srv.delivered_count() >= 3, 30, "3 deliveries at the sink")
    assert len(srv.messages()) == 3
    deferred = pf.maillog.wait_for(lambda ln: "status=deferred" in ln.text, timeout=30,
                                   count=n - 3, what="a status=deferred line per message")
    assert {ln.queue_id for ln in deferred} == set(pf.queue_files("deferred"))
    assert all("scheduler policy error" in ln.text for ln in deferred), deferred[0].text

    # The fix: back to nqmgr, postfix reload, postqueue -f.
    old_pid = pf.qmgr_pid()
    pf.write_pyqmgr_cf({"scheduler_policy": "nqmgr"})
    pf.reload()
    pf.wait_until(lambda: pf.pids("qmgr") not in ([], [old_pid]), 30,
                  "a new qmgr process after postfix reload")
    pf.flush()
    pf.wait_until(lambda: len(srv.messages()) >= n, 60, f"all {n} messages at the sink")
    pf.wait_queue_empty(30)
    got = sorted(r for m in srv.messages() for r in m.recipients)
    assert got == sorted(f"r{i}@d.example" for i in range(n)), "each exactly once"
    pf.wait_removed(qids)


SYNTAX_ERROR = "from pyqmgr.scheduler.policy import Policy\n\nclass Broken(Policy)\n    pass\n"


def _bad_cf(pf: PostfixInstance, case: str) -> tuple[str, str, str]:
    """Set up one bad configuration; return (file named, parameter named, reason)."""
    cf = os.path.join(pf.config_dir, "pyqmgr.cf")
    if case == "unknown name":
        pf.write_pyqmgr_cf({"scheduler_policy": "nosuch"})
        return cf, "scheduler_policy", 'unknown scheduler policy "nosuch"'
    if case == "missing module":
        pf.write_pyqmgr_cf({"smtp_scheduler_policy": "module:/nonexistent.py"})
        return cf, "smtp_scheduler_policy", "/nonexistent.py"
    if case == "syntax error":
        path = install_policy(pf, "broken_policy.py", SYNTAX_ERROR)
        pf.write_pyqmgr_cf({"scheduler_policy": f"module:{path}"})
        return cf, "scheduler_policy", "does not load: SyntaxError"
    if case == "bad knob":
        pf.write_pyqmgr_cf({"scheduler_policy": "finch", "finch_max_message_concurrency": "ten"})
        return cf, "finch_max_message_concurrency", '"ten" is not an integer'
    assert case == "fudge factor"
    pf.write_pyqmgr_cf({"scheduler_policy": "oqmgr"})
    pf.set_main(qmgr_fudge_factor="5")
    return os.path.join(pf.config_dir, "main.cf"), "qmgr_fudge_factor", "5"


@pytest.mark.parametrize("case", ["unknown name", "missing module", "syntax error",
                                  "bad knob", "fudge factor"])
def test_bad_policy_settings_are_fatal_and_mail_stays_queued(postfix_instance, sink, case):
    srv: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", start=False,
        transports={"d.example": f"smtp:[127.0.0.1]:{srv.port}"})
    path, param, reason = _bad_cf(pf, case)
    pf.start()
    (qid,) = pf.smtp_send([("s@test.example", ["r@d.example"])])

    def is_fatal(ln: LogLine) -> bool:
        return ln.program_name == "qmgr" and ln.severity == "fatal"

    fatal = pf.maillog.wait_for(is_fatal, timeout=30, what=f"qmgr's fatal line ({case})")[0]
    assert reason in fatal.text, fatal.text
    # The mail waits: not delivered, still a file in the queue.
    assert pf.queue_path("incoming", qid) or pf.queue_path("active", qid), (
        f"{qid} left the queue: {pf.queue_counts()}")
    assert srv.delivered_count() == 0
    assert not [ln for ln in pf.maillog.lines(queue_id=qid) if "status=" in ln.text]
    if case == "fudge factor":
        # main.cf's errors are worded as Postfix words them: they name the parameter.
        assert param in fatal.text, fatal.text
        return
    named = f"fatal: {path}: parameter {param}: "
    assert fatal.text.startswith(named), fatal.text


def test_raising_policy_text_is_a_single_policy_module(tmp_path):
    """The inline raising policy is itself a valid module:PATH policy (one subclass)."""
    path = tmp_path / "raising.py"
    path.write_text(RAISING_POLICY)
    cls = load(f"module:{path}")
    assert cls.name == "raising"
    assert cls.__name__ == "Raising"


#: A policy whose knobs are declared wrongly (a number, not a mapping): nothing any
#: check of pyqmgr's foresaw, so it breaks start-up where it is used.
BAD_KNOBS = ("from pyqmgr.scheduler.policy import Policy\n\n"
             "class BadKnobs(Policy):\n    name = 'badknobs'\n    knobs = 5\n")


def test_an_unforeseen_error_at_start_up_is_one_fatal_line_status_shows(postfix_instance):
    """Issue #43: an error nobody foresaw at start-up was master's bare 'exit status 1';
    now it is one fatal line naming the error and where in pyqmgr it happened, and
    pyqmgr status shows the same line. check names the file instead of crashing."""
    pf: PostfixInstance = postfix_instance(qmgr="pyqmgr", start=False)
    path = install_policy(pf, "bad_knobs.py", BAD_KNOBS)
    pf.write_pyqmgr_cf({"scheduler_policy": f"module:{path}"})
    checked = subprocess.run([sys.executable, "-m", "pyqmgr.cli", "check", "--config-dir",
                              pf.config_dir], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in checked.stderr, checked.stderr
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "unexpected error: " in checked.stdout, checked.stdout
    pf.start()
    fatal = pf.maillog.wait_for(
        lambda ln: ln.program_name == "qmgr" and ln.severity == "fatal", timeout=30,
        what="qmgr's fatal line")[0]
    # What the error is depends on the build (the compiled one checks the mapping's type
    # first: a TypeError); that it is one line naming where is what matters.
    assert fatal.text.startswith("fatal: unexpected error: "), fatal.text
    assert "(at pyqmgr/" in fatal.text, fatal.text
    status = subprocess.run([sys.executable, "-m", "pyqmgr.cli", "status", "--config-dir",
                             pf.config_dir], capture_output=True, text=True, timeout=60)
    assert status.returncode != 0
    assert fatal.text.removeprefix("fatal: ") in status.stderr, status.stderr
