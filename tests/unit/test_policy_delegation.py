"""The policy delegation protocol without I/O: the request's bytes, the reply parser with
every malformed and oversized input it must refuse, the action classifier for every
kind of action, the delay extension, the warning gate and endpoint parsing."""

from __future__ import annotations

import pytest

from pyqmgr.postfix.policy_delegation import (
    MAX_ATTRS,
    MAX_DELAY,
    MAX_LINE,
    MAX_REPLY,
    MIN_DELAY,
    DeliveryRequest,
    Endpoint,
    PolicyError,
    PolicyProtocolError,
    PolicyReply,
    ReplyParser,
    Verdict,
    WarnGate,
    classify,
    clean_value,
    decide,
    encode_request,
    parse_endpoint,
)

# -- the request -----------------------------------------------------------------------


def test_request_is_ordered_lines_ended_by_an_empty_line():
    data = encode_request([("request", "smtpd_access_policy"), ("size", 123),
                           ("sender", "")])
    assert data == b"request=smtpd_access_policy\nsize=123\nsender=\n\n"


def test_delivery_request_sends_what_the_readme_documents_in_order():
    request = DeliveryRequest(queue_id="4XyZ1", sender="s@example.org",
                              recipient="r@example.com", recipient_count=3, size=2048,
                              instance="4XyZ1.1", transport="smtp", nexthop="example.com",
                              destination_window=5, destination_in_flight=2, attempt=1)
    assert request.encode() == (
        b"request=smtpd_access_policy\nprotocol_state=DELIVERY\nprotocol_name=\n"
        b"client_address=\nclient_name=\nreverse_client_name=\nhelo_name=\n"
        b"sender=s@example.org\nrecipient=r@example.com\nrecipient_count=3\n"
        b"queue_id=4XyZ1\ninstance=4XyZ1.1\nsize=2048\npolicy_context=\n"
        b"transport=smtp\nnexthop=example.com\ndestination_window=5\n"
        b"destination_in_flight=2\nattempt=1\n\n")


@pytest.mark.parametrize("value, sent", [
    ("a\nb", "a?b"), ("a\r\nb", "a??b"), ("a\0b", "a?b"), ("plain", "plain"), ("", ""),
])
def test_unsendable_characters_in_values_become_question_marks(value, sent):
    assert clean_value(value) == sent
    assert encode_request([("recipient", value)]) == f"recipient={sent}\n\n".encode()


def test_a_non_utf8_address_goes_out_byte_for_byte():
    # Addresses from queue files are decoded with surrogateescape; Postfix sends raw bytes.
    value = b"caf\xe9@example.com".decode("utf-8", "surrogateescape")
    assert encode_request([("sender", value)]) == b"sender=caf\xe9@example.com\n\n"


@pytest.mark.parametrize("name", ["", "a=b", "a\nb", "a\0b", "a\rb"])
def test_names_the_protocol_cannot_carry_are_programming_errors(name):
    with pytest.raises(ValueError, match="bad policy attribute name"):
        encode_request([(name, "x")])


@pytest.mark.parametrize("value, error", [(-1, ValueError), (True, TypeError),
                                          (1.5, TypeError), (None, TypeError)])
def test_values_that_are_not_text_or_counts_are_refused(value, error):
    with pytest.raises(error):
        encode_request([("size", value)])


# -- the reply parser ------------------------------------------------------------------


def test_reply_fed_byte_by_byte_is_none_until_the_empty_line():
    data = b"action=DEFER 4.7.1 later\nfoo=bar\n\n"
    parser = ReplyParser()
    for i in range(len(data) - 1):
        assert parser.feed(data[i:i + 1]) is None, i
    reply = parser.feed(data[-1:])
    assert reply == PolicyReply((("action", "DEFER 4.7.1 later"), ("foo", "bar")))
    assert reply.action == "DEFER 4.7.1 later"
    assert parser.trailing == b""


def test_first_action_wins_and_extra_attributes_are_kept():
    # Postfix's scanner takes the first instance and skips the rest.
    reply = ReplyParser().feed(b"x=1\naction=OK\naction=REJECT\ndelay=30\n\n")
    assert reply is not None
    assert reply.action == "OK" and reply.get("delay") == "30" and reply.get("y") is None


def test_crlf_lines_are_tolerated():
    reply = ReplyParser().feed(b"action=DUNNO\r\n\r\n")
    assert reply is not None and reply.action == "DUNNO"


def test_bytes_after_the_reply_are_kept_as_trailing():
    parser = ReplyParser()
    assert parser.feed(b"action=DUNNO\n\naction=DUNNO\n\n") is not None
    assert parser.trailing == b"action=DUNNO\n\n"


def test_value_may_contain_equals_signs():
    reply = ReplyParser().feed(b"action=PREPEND X-A: a=b\n\n")
    assert reply is not None and reply.action == "PREPEND X-A: a=b"


@pytest.mark.parametrize("data, message", [
    (b"this is garbage\n\n", "without '='"),
    (b"=DUNNO\n\n", "without name"),
    (b"action=DUN\0NO\n\n", "NUL"),
    (b"action=caf\xe9\n\n", "not UTF-8"),
    (b"result=DUNNO\n\n", "without action"),
    (b"\n", "empty reply"),
])
def test_malformed_replies_raise_a_clear_error(data, message):
    with pytest.raises(PolicyProtocolError, match=message) as info:
        ReplyParser().feed(data)
    assert info.value.reason == PolicyError.MALFORMED
    assert isinstance(info.value, PolicyError)  # the one type the caller catches


def test_a_line_at_the_limit_is_accepted():
    reply = ReplyParser().feed(b"action=" + b"x" * (MAX_LINE - 7) + b"\n\n")
    assert reply is not None and len(reply.action) == MAX_LINE - 7


def test_an_endless_line_is_refused_as_soon_as_it_passes_the_limit():
    parser = ReplyParser()
    assert parser.feed(b"action=" + b"x" * (MAX_LINE - 7)) is None
    with pytest.raises(PolicyProtocolError, match="longer than 8192"):
        parser.feed(b"xx")  # no newline yet: refused without waiting for one


def test_an_overlong_complete_line_is_refused():
    with pytest.raises(PolicyProtocolError, match="longer than 8192"):
        ReplyParser().feed(b"action=" + b"x" * MAX_LINE + b"\n\n")


def test_too_many_attributes_are_refused():
    data = b"action=DUNNO\n" + b"a=b\n" * MAX_ATTRS + b"\n"
    with pytest.raises(PolicyProtocolError, match=f"more than {MAX_ATTRS}"):
        ReplyParser().feed(data)


def test_a_reply_over_the_total_limit_is_refused_before_it_ends():
    line = b"a=" + b"x" * 8000 + b"\n"
    parser = ReplyParser()
    with pytest.raises(PolicyProtocolError, match=f"longer than {MAX_REPLY}"):
        for _ in range(MAX_REPLY // len(line) + 2):
            parser.feed(line)


# -- the classifier --------------------------------------------------------------------

DELIVER, DEFER, HOLD, REJECT, UNKNOWN = (Verdict.DELIVER, Verdict.DEFER, Verdict.HOLD,
                                         Verdict.REJECT, Verdict.UNKNOWN)


@pytest.mark.parametrize("action, verdict, code, dsn, text", [
    ("DUNNO", DELIVER, None, None, ""),
    ("dunno", DELIVER, None, None, ""),
    ("OK whatever", DELIVER, None, None, "whatever"),
    ("RELAY", DELIVER, None, None, ""),
    ("1700000000", DELIVER, None, None, ""),  # all-numeric: access(5)'s "probably OK"
    ("  Dunno  ", DELIVER, None, None, ""),
    ("DEFER", DEFER, 450, "4.7.1", "Access denied"),
    ("defer try later", DEFER, 450, "4.7.1", "try later"),
    ("DEFER 4.7.2 slow down", DEFER, 450, "4.7.2", "slow down"),
    ("DEFER\t4.4.5 tab", DEFER, 450, "4.4.5", "tab"),
    ("DEFER_IF_PERMIT", DEFER, 450, "4.7.1", "Service unavailable"),
    ("defer_if_reject greylisted", DEFER, 450, "4.7.1", "greylisted"),
    ("450 4.7.1 too many", DEFER, 450, "4.7.1", "too many"),
    ("421 closing", DEFER, 421, "4.7.1", "closing"),
    ("450", DEFER, 450, "4.7.1", "Service unavailable"),  # no text: still not "deliver"
    ("4.2.1 mailbox busy", DEFER, 450, "4.2.1", "mailbox busy"),
    ("HOLD", HOLD, None, None, "triggers HOLD action"),
    ("hold quarantine", HOLD, None, None, "quarantine"),
    ("REJECT", REJECT, 554, "5.7.1", "Access denied"),
    ("reject 5.7.0 not here", REJECT, 554, "5.7.0", "not here"),
    ("550 5.1.1 unknown user", REJECT, 550, "5.1.1", "unknown user"),
    ("554", REJECT, 554, "5.7.1", "Access denied"),
    ("5.7.1 go away", REJECT, 554, "5.7.1", "go away"),
])
def test_every_action_kind_is_classified_with_code_and_text(action, verdict, code, dsn,
                                                            text):
    decision = classify(action)
    assert (decision.verdict, decision.code, decision.dsn, decision.text) == (
        verdict, code, dsn, text)
    assert decision.action == action
    if verdict is not Verdict.UNKNOWN:
        assert decision.notes == ()


def test_reason_for_logs():
    assert classify("450 4.7.1 too many").reason == "450 4.7.1 too many"
    assert classify("HOLD quarantine").reason == "quarantine"


@pytest.mark.parametrize("action, verdict, code, dsn", [
    ("450 5.7.1 class mismatch", DEFER, 450, "4.7.1"),
    ("DEFER 5.7.1 mismatch", DEFER, 450, "4.7.1"),
    ("REJECT 4.7.1 mismatch", REJECT, 554, "5.7.1"),
])
def test_the_smtp_code_wins_over_the_status_class_with_a_note(action, verdict, code, dsn):
    decision = classify(action)
    assert (decision.verdict, decision.code, decision.dsn) == (verdict, code, dsn)
    assert len(decision.notes) == 1 and "does not match" in decision.notes[0]


@pytest.mark.parametrize("action", ["WARN too many messages", "info noted", "WARN"])
def test_warn_and_info_deliver_and_hand_back_their_text_to_log(action):
    decision = classify(action)
    assert decision.verdict is Verdict.DELIVER
    assert len(decision.notes) == 1 and "policy service" in decision.notes[0]


@pytest.mark.parametrize("action, why", [
    ("PREPEND X-Policy: yes", "smtpd action"),
    ("FILTER smtp:[127.0.0.1]:10025", "smtpd action"),
    ("REDIRECT other@example.com", "smtpd action"),
    ("BCC archive@example.com", "smtpd action"),
    ("DISCARD spam", "smtpd action"),
    ("HANGUP", "smtpd action"),
    ("DELAY 1h", "smtpd action"),
    ("permit_mynetworks", "unknown action"),
    ("250 2.0.0 ok", "unknown action"),
    ("2.0.0 fine", "unknown action"),
    ("", "empty action"),
])
def test_actions_that_mean_nothing_for_a_delivery_are_unknown_with_a_note(action, why):
    decision = classify(action)
    assert decision.verdict is Verdict.UNKNOWN
    assert len(decision.notes) == 1
    assert why in decision.notes[0] and "treated as DUNNO" in decision.notes[0]


# -- the delay extension ---------------------------------------------------------------


def _decide(*attrs: tuple[str, str]):
    return decide(PolicyReply(tuple(attrs)))


@pytest.mark.parametrize("value, seconds", [
    ("30", 30.0), ("30s", 30.0), ("5m", 300.0), ("2h", 7200.0), ("1d", 86400.0),
])
def test_a_defer_reply_may_name_its_delay(value, seconds):
    decision = _decide(("action", "DEFER slow down"), ("delay", value))
    assert decision.delay == seconds and decision.notes == ()


@pytest.mark.parametrize("value, seconds, note", [
    ("0", MIN_DELAY, "raised to 1s"),
    ("2w", MAX_DELAY, "lowered to 86400s"),
    ("soon", None, "not a time, ignored"),
    ("10x", None, "not a time, ignored"),
    ("-5", None, "not a time, ignored"),
])
def test_a_delay_out_of_bounds_is_clamped_and_a_bad_one_ignored(value, seconds, note):
    decision = _decide(("action", "450 4.7.1 later"), ("delay", value))
    assert decision.verdict is Verdict.DEFER and decision.delay == seconds
    assert len(decision.notes) == 1 and note in decision.notes[0]


def test_a_delay_means_nothing_without_a_defer():
    assert _decide(("action", "DUNNO"), ("delay", "30")).delay is None
    assert _decide(("action", "DEFER"),).delay is None


# -- the warning gate ------------------------------------------------------------------


def test_warn_gate_lets_one_warning_through_a_minute_and_counts_the_rest():
    gate = WarnGate(60.0)
    assert gate.allow(1000.0) == 0
    assert gate.allow(1001.0) is None
    assert gate.allow(1059.9) is None
    assert gate.held == 2
    assert gate.allow(1060.0) == 2
    assert gate.allow(1061.0) is None
    assert gate.allow(1200.0) == 1
    assert gate.held == 0


# -- endpoints -------------------------------------------------------------------------


@pytest.mark.parametrize("spec, endpoint", [
    ("inet:127.0.0.1:10040", Endpoint("inet", host="127.0.0.1", port=10040)),
    ("inet:policy.example.com:10040", Endpoint("inet", host="policy.example.com",
                                               port=10040)),
    ("inet:[::1]:10040", Endpoint("inet", host="::1", port=10040)),
    ("inet:localhost:smtp", Endpoint("inet", host="localhost", port=25)),
    ("unix:private/policy", Endpoint("unix", path="private/policy")),
    ("unix:/run/policy.sock", Endpoint("unix", path="/run/policy.sock")),
])
def test_endpoints_parse(spec, endpoint):
    assert parse_endpoint(spec) == endpoint


def test_endpoint_text_round_trips():
    for spec in ("inet:127.0.0.1:10040", "inet:[::1]:10040", "unix:private/policy"):
        assert str(parse_endpoint(spec)) == spec


def test_a_relative_unix_path_is_joined_to_the_base_directory():
    endpoint = parse_endpoint("unix:private/policy", base_dir="/var/spool/postfix")
    assert endpoint.path == "/var/spool/postfix/private/policy"
    assert parse_endpoint("unix:/abs/policy", base_dir="/x").path == "/abs/policy"


@pytest.mark.parametrize("spec, message", [
    ("tcp:127.0.0.1:10040", "expected inet:host:port or unix:pathname"),
    ("127.0.0.1:10040", "expected inet:host:port or unix:pathname"),
    ("private/policy", "expected inet:host:port or unix:pathname"),
    ("inet:127.0.0.1", "expected inet:host:port"),
    ("inet::10040", "empty host"),
    ("inet:127.0.0.1:", "empty port"),
    ("inet:127.0.0.1:0", "out of range"),
    ("inet:127.0.0.1:65536", "out of range"),
    ("inet:127.0.0.1:no-such-service-here", "unknown service"),
    ("inet:::1:10040", "IPv6 address must be in brackets"),
    ("inet:[::1]10040", "expected inet:\\[address\\]:port"),
    ("unix:", "empty pathname"),
    ("unix:/" + "x" * 120, "longer than 107 bytes"),
])
def test_bad_endpoints_are_configuration_errors_that_say_why(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_endpoint(spec)
