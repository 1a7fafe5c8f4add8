"""pyqmgr status while the daemon is fatal and master(8) throttles it (issue #43).

A bad pyqmgr.cf makes the daemon exit with a fatal line; master throttles the qmgr
service for service_throttle_time. Status must show the fatal line to the users who
may run it (who may not read the maillog), with its time and what to do; and what
ends master's wait at once is measured here, on a real master, as master(8)'s source
says it (master_conf.c, master_service.c, master_spawn.c): a reload keeps the service
and so its throttle timer; a service master makes anew starts at once.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
import time

from pyqmgr.control import last_fatal
from pyqmgr.testbed.instance import PostfixInstance
from tests.test_control import cli, wait_for_channel
from tests.trust_helpers import throwaway_user

THROTTLE = 20  # service_throttle_time here, seconds (Postfix's default is 60)


def fail_start(pf: PostfixInstance, mark: int) -> last_fatal.LastFatal:
    """Break pyqmgr.cf and reload: the next daemon dies with a fatal line; return the
    record it kept."""
    with open(os.path.join(pf.config_dir, "pyqmgr.cf"), "w") as f:
        f.write("a line without an equals sign\n")
    pf.reload()
    pf.maillog.wait_for(lambda ln: ln.program_name == "qmgr" and ln.text.startswith("fatal:"),
                        timeout=30, since=mark, what="the daemon's fatal line")
    pf.maillog.wait_for(lambda ln: "bad command startup -- throttling" in ln.text, timeout=10,
                        since=mark, what="master throttling the qmgr service")
    kept = last_fatal.read(pf.queue_dir)
    assert kept is not None, os.listdir(os.path.join(pf.queue_dir, "pyqmgr"))
    return kept


def fix(pf: PostfixInstance) -> None:
    os.unlink(os.path.join(pf.config_dir, "pyqmgr.cf"))


def answered_after(pf: PostfixInstance, start: float) -> float:
    wait_for_channel(pf, timeout=THROTTLE + 30)
    return time.time() - start


def test_status_shows_the_fatal_and_the_way_to_end_masters_wait(postfix_instance,
                                                                pyqmgr_for_others):
    others = pyqmgr_for_others
    with throwaway_user() as allowed:
        pf: PostfixInstance = postfix_instance(
            qmgr="pyqmgr",
            main_cf={"service_throttle_time": f"{THROTTLE}s",
                     "authorized_mailq_users": f"root, {allowed.pw_name}"})
        wait_for_channel(pf)
        nobody = pwd.getpwnam("nobody")
        record = os.path.join(pf.queue_dir, last_fatal.PATH)
        assert not os.path.exists(record)

        kept = fail_start(pf, pf.maillog.mark())
        assert "line 1: missing '=' after attribute name" in kept.text, kept
        assert time.time() - 30 < kept.time <= time.time()
        st = os.stat(record)
        assert stat.S_IMODE(st.st_mode) & 0o077 in (0, 0o040), oct(st.st_mode)  # 0600 + ACL

        status = cli(pf, "status")
        print(status.stderr)
        assert status.returncode == 69 and status.stdout == ""
        err = status.stderr
        assert "the pyqmgr daemon is not running" in err
        assert "its last start failed at " in err
        assert f"  fatal: {kept.text}\n" in err
        assert f"again {THROTTLE}s after each failed start (service_throttle_time)" in err
        assert (f"'postfix -c {pf.config_dir} stop; postfix -c {pf.config_dir} start' starts "
                "it at once ('postfix reload' does not end master's wait)") in err
        # A user authorized_mailq_users names reads it (the maillog is not theirs)...
        theirs = cli(pf, "status", user=allowed, others=others)
        assert theirs.returncode == 69 and f"  fatal: {kept.text}\n" in theirs.stderr, theirs
        # ... one it does not name is told where it is and that it is not for them.
        refused = cli(pf, "status", user=nobody, others=others)
        assert refused.returncode == 69 and kept.text not in refused.stderr
        assert f"kept in {record}, for the users authorized_mailq_users" in refused.stderr
        scripted = cli(pf, "status", "--json")
        reply = json.loads(scripted.stdout)
        assert (reply["ok"], reply["code"]) == (False, "unavailable")
        assert reply["last_fatal"]["text"] == kept.text
        assert reply["last_fatal"]["service_throttle_time"] == THROTTLE

        # The fix, then 'postfix reload': master keeps the service, and its wait.
        fix(pf)
        pf.reload()
        waited = answered_after(pf, kept.time)
        print(f"after a reload the daemon answered {waited:.1f} s after its fatal")
        # (master's timers count whole seconds: the wait ends in its last second)
        assert waited >= THROTTLE - 2, f"a reload ended the throttle ({waited:.1f} s)"
        assert not os.path.exists(record), "a good start removes the kept fatal"
        ok = cli(pf, "status")
        assert ok.returncode == 0 and "active queue:" in ok.stdout, ok.stderr

        # With authorized_mailq_users at its default, everyone reads the kept line.
        pf.set_main(authorized_mailq_users="static:anyone")
        kept = fail_start(pf, pf.maillog.mark())
        assert stat.S_IMODE(os.stat(record).st_mode) == 0o644
        public = cli(pf, "status", user=nobody, others=others)
        assert public.returncode == 69 and f"  fatal: {kept.text}\n" in public.stderr
        # The fix, then 'postfix stop; postfix start': a new master, no wait.
        fix(pf)
        began = time.time()
        pf.stop()
        pf.start()
        waited = answered_after(pf, began)
        print(f"after postfix stop; postfix start the daemon answered in {waited:.1f} s")
        assert waited < THROTTLE - 5 and time.time() - kept.time < THROTTLE, waited

        # A reload that takes the qmgr service away and one that brings it back make
        # master create the service anew: no wait either, and smtpd keeps running.
        kept = fail_start(pf, pf.maillog.mark())
        fix(pf)
        began = time.time()
        pf.enable_qmgr(pf.disable_qmgr())
        waited = answered_after(pf, began)
        print(f"after the service was removed and restored the daemon answered in "
              f"{waited:.1f} s")
        assert waited < THROTTLE - 5 and time.time() - kept.time < THROTTLE, waited


def test_a_first_start_that_fails_keeps_its_fatal_in_a_directory_it_makes(postfix_instance,
                                                                          pyqmgr_for_others):
    """No daemon ever ran: $queue_directory/pyqmgr is not there yet. The daemon, still
    root, makes it (mail_owner's, 0755, as the control channel would) for the record."""
    pf: PostfixInstance = postfix_instance(qmgr="pyqmgr", start=False)
    directory = os.path.join(pf.queue_dir, last_fatal.DIRECTORY)
    assert not os.path.exists(directory)
    with open(os.path.join(pf.config_dir, "pyqmgr.cf"), "w") as f:
        f.write("a line without an equals sign\n")
    pf.start()
    pf.wait_until(lambda: last_fatal.read(pf.queue_dir) is not None, 30,
                  "the first start's fatal kept")
    st = os.lstat(directory)
    uid, gid = pf.mail_owner_ids()
    assert stat.S_ISDIR(st.st_mode) and (st.st_uid, st.st_gid) == (uid, gid)
    assert stat.S_IMODE(st.st_mode) == 0o755
    status = cli(pf, "status", user=pwd.getpwnam("nobody"), others=pyqmgr_for_others)
    assert status.returncode == 69 and "missing '=' after attribute name" in status.stderr
