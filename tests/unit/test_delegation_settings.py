"""Delivery policy delegation's settings and bookkeeping in the daemon, without Postfix.

Every form of every setting is checked at start-up, and a bad one is an error naming
pyqmgr.cf and the parameter actually set; ``<transport>_NAME`` wins over ``NAME`` and an
empty service turns a transport off; the error and retry transports never ask; the
attempt number counts activations per queue id; the status reply gains each asking
transport's counters, and ``pyqmgr status`` shows them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pyqmgr.control.render import status_lines
from pyqmgr.daemon import delegation
from pyqmgr.daemon.delegation import Delegation, DelegationSetup, annotate
from pyqmgr.pyqmgr_cf import PyqmgrCfError, from_text

CF = "/etc/postfix/pyqmgr.cf"


def settings(text: str):
    return from_text(text, CF)


def test_nothing_set_means_off():
    assert delegation.setup(settings("")) is None
    assert delegation.setup(settings("delivery_policy_timeout = 3s\n")) is None
    assert delegation.setup(settings("delivery_policy_service =\n")) is None


def test_per_transport_forms_and_defaults():
    found = delegation.setup(settings(
        "delivery_policy_service = inet:127.0.0.1:10040\n"
        "relay_delivery_policy_service = unix:private/policy\n"
        "local_delivery_policy_service =\n"
        "smtp_delivery_policy_timeout = 500ms\n"
        "delivery_policy_default_action = defer\n"
        "relay_delivery_policy_reject = BOUNCE\n"
        "relay_delivery_policy_hold = Defer\n"
        "delivery_policy_connections = 2\n"
        "delivery_policy_context = outbound\n"))
    assert found is not None
    smtp = found.for_transport("smtp")
    assert smtp is not None and str(smtp.endpoint) == "inet:127.0.0.1:10040"
    assert (smtp.timeout, smtp.default_action, smtp.defer_delay, smtp.reject,
            smtp.connections, smtp.context) == (0.5, "DEFER", 60.0, "defer", 2, "outbound")
    relay = found.for_transport("relay")
    assert relay is not None and str(relay.endpoint) == "unix:private/policy"
    assert relay.reject == "bounce" and relay.timeout == 5.0 and relay.hold == "defer"
    assert smtp.hold == "hold", "stock Postfix's HOLD, unless refused"
    assert found.for_transport("local") is None, "an empty service turns it off"
    assert found.for_transport("error") is None and found.for_transport("retry") is None


@pytest.mark.parametrize("line, param, text", [
    ("delivery_policy_service = tcp:1.2.3.4:5", "delivery_policy_service",
     "expected inet:host:port or unix:pathname"),
    ("smtp_delivery_policy_service = inet:127.0.0.1:99999", "smtp_delivery_policy_service",
     "port 99999 out of range"),
    ("smtp_delivery_policy_timeout = soon", "smtp_delivery_policy_timeout",
     "bad duration 'soon'"),
    ("delivery_policy_timeout = 10m", "delivery_policy_timeout", "out of range"),
    ("delivery_policy_defer_delay = 2d", "delivery_policy_defer_delay", "out of range"),
    ("delivery_policy_default_action = OK", "delivery_policy_default_action",
     '"OK" is neither DUNNO (deliver) nor DEFER'),
    ("relay_delivery_policy_reject = discard", "relay_delivery_policy_reject",
     '"discard" is neither defer nor bounce'),
    ("delivery_policy_hold = discard", "delivery_policy_hold",
     '"discard" is neither hold nor defer'),
    ("delivery_policy_connections = 0", "delivery_policy_connections",
     '"0" is not a whole number from 1 to 100'),
])
def test_a_bad_value_names_the_file_and_the_parameter(line, param, text):
    with pytest.raises(PyqmgrCfError) as err:
        delegation.setup(settings("delivery_policy_service = inet:127.0.0.1:10040\n"
                                  + line + "\n"))
    message = str(err.value)
    assert message.startswith(f"{CF}: parameter {param}: "), message
    assert text in message, message


def test_the_attempt_counts_activations_per_queue_id():
    setup = DelegationSetup(settings("delivery_policy_service = inet:127.0.0.1:1\n"))
    d = Delegation(SimpleNamespace(), setup)  # type: ignore[arg-type]

    def am(qid: str, queue: str):
        return SimpleNamespace(queue_id=qid, source=queue, policy_attempt=None)

    first = am("A1", "incoming")
    assert d.attempt(first) == 1 and d.attempt(first) == 1, "once per activation"
    assert d.attempt(am("A1", "deferred")) == 2
    assert d.attempt(am("A1", "deferred")) == 3
    assert d.attempt(am("B2", "deferred")) == 2, "from deferred/: at least 2"
    assert d.attempt(am("C3", "incoming")) == 1


def test_status_shows_each_asking_transports_service():
    setup = DelegationSetup(settings("smtp_delivery_policy_service = inet:127.0.0.1:1\n"))
    d = Delegation(SimpleNamespace(), setup)  # type: ignore[arg-type]
    client = SimpleNamespace(open_connections=lambda: 3)
    svc = delegation.Service(setup.for_transport("smtp"), client,  # type: ignore[arg-type]
                             delegation.WarnGate())
    svc.counters.asked, svc.counters.deliver, svc.counters.defer = 12, 9, 3
    d._services["smtp"] = svc
    d._services["local"] = None
    reply = annotate({"messages": 1, "recipients": 1, "transports": [
        {"name": "smtp", "policy": "nqmgr"}, {"name": "local", "policy": "nqmgr"}],
        "destinations": []}, d)
    transports = reply["transports"]
    assert transports[0]["delivery_policy"] == {
        "service": "inet:127.0.0.1:1", "asked": 12, "deliver": 9, "defer": 3, "hold": 0,
        "reject": 0, "unknown": 0, "errors": 0, "connections": 3, "default_action": "DUNNO"}
    assert "delivery_policy" not in transports[1]
    text = "\n".join(status_lines(reply))
    assert "POLICY SERVICE" in text
    row = [ln for ln in text.splitlines() if ln.startswith("smtp") and "inet:" in ln][0]
    assert row.split() == ["smtp", "inet:127.0.0.1:1", "12", "9", "3", "0", "0", "0", "0",
                           "3"]
