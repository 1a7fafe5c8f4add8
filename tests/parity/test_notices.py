"""Parity scenarios for trace and verification requests, probes, double bounces, locks."""

from __future__ import annotations

import fcntl
import os
import smtplib
import time

from tests.parity.common import outcome, settle, sink_config, wait_log


def test_sendmail_v_trace(side_by_side, sink):
    srv = sink()

    def scenario(inst, qmgr):
        inst.sendmail(inst.local_address, ["v@sink.example"], extra_args=["-v"])
        wait_log(inst, lambda ln: ln.program_name == "local" and ln.status == "sent",
                 "the delivery report delivered to the sender", timeout=40)
        settle(inst)
        return outcome(inst, grouped=True)

    side_by_side(scenario, name="sendmail -v (trace)", item="4.2 expiry and notices",
                 description="A message sent with sendmail -v is delivered and its "
                             "sender gets the trace report from the bounce daemon.",
                 **sink_config(srv))


def test_sendmail_bv_verification(side_by_side, sink):
    srv = sink()

    def scenario(inst, qmgr):
        start = len(srv.messages())
        inst.sendmail(inst.local_address, ["bv@sink.example"], extra_args=["-bv"])
        wait_log(inst, lambda ln: ln.program_name == "local" and ln.status == "sent",
                 "the verification report delivered to the sender", timeout=40)
        settle(inst)
        return outcome(inst, grouped=True, messages_at_sink=len(srv.messages()) - start)

    side_by_side(scenario, name="sendmail -bv (address verification request)",
                 item="4.2 expiry and notices",
                 description="sendmail -bv: nothing is delivered; the sender gets a "
                             "report of what would happen.", **sink_config(srv))


def test_address_verification_probe(side_by_side, sink):
    srv = sink()

    def scenario(inst, qmgr):
        with smtplib.SMTP("127.0.0.1", inst.smtpd_port, timeout=60) as smtp:
            smtp.ehlo()
            smtp.mail("s@test.example")
            code, _ = smtp.rcpt("probe@sink.example")
        wait_log(inst, lambda ln: ln.program_name == "qmgr" and ln.text.endswith("removed"),
                 "the probe removed", timeout=40)
        settle(inst)
        return outcome(inst, rcpt_reply=code)

    side_by_side(scenario, name="address verification probe", item="4.2 expiry and notices",
                 description="reject_unverified_recipient makes the verify service send "
                             "a probe through the queue; qmgr delivers it as a probe "
                             "(nothing reaches the mailbox) and smtpd accepts the "
                             "recipient.",
                 **sink_config(srv, smtpd_recipient_restrictions="reject_unverified_recipient, "
                                                          "permit_mynetworks, reject"))


def test_double_bounce_is_discarded(side_by_side, sink):
    srv = sink(replies={"gone@sink.example": "550 5.1.1 no such user",
                        "nobody-here@sink.example": "550 5.1.1 no postmaster here"})

    def scenario(inst, qmgr):
        with smtplib.SMTP("127.0.0.1", inst.smtpd_port, timeout=60) as smtp:
            smtp.ehlo()
            smtp.sendmail("", ["gone@sink.example"], b"Subject: x\r\n\r\nbody\r\n")
        wait_log(inst, lambda ln: ln.to == "nobody-here@sink.example"
                 and ln.status == "bounced", "the postmaster notice failing", timeout=40)
        settle(inst)
        return outcome(inst, grouped=True)

    side_by_side(scenario, name="double-bounce discard", item="4.2 expiry and notices",
                 description="A null-sender message bounces; the postmaster notice "
                             "(from double-bounce) cannot be delivered either and qmgr "
                             "discards it instead of bouncing it again.",
                 **sink_config(srv, notify_classes="bounce",
                        **{"2bounce_notice_recipient": "nobody-here@sink.example"}))


def test_locked_file_is_skipped(side_by_side, sink):
    srv = sink()

    def scenario(inst, qmgr):
        (qid,) = inst.preload([("s@sink.example", ["l@sink.example"])])
        path = os.path.join(inst.queue_dir, "incoming", qid)
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            inst.release_preload()
            wait_log(inst, lambda ln: ln.queue_id == qid and "still being delivered" in ln.text,
                     "the locked file skipped")
            time.sleep(0.5)
        finally:
            os.close(fd)
        inst.postqueue("-f")
        wait_log(inst, lambda ln: ln.queue_id == qid and ln.text.endswith("removed"),
                 "delivery once unlocked")
        settle(inst)
        return outcome(inst)

    side_by_side(scenario, name="file locked by an agent", item="4.3 hold and admin tools",
                 description="A queue file another process holds locked is skipped "
                             "('skipped, still being delivered') and delivered once "
                             "the lock is gone.", **sink_config(srv))
