"""argv as master(8) builds it (master_trigger_logging.md §1.1)."""

import pytest

from pyqmgr.postfix.master import UsageError, generation_from_env, parse_argv


def test_stock_qmgr_argv():
    opts = parse_argv(["pyqmgr/qmgr", "-l", "-t", "unix", "-u"])
    assert opts.progname == "qmgr" and opts.service_name == "qmgr"
    assert opts.alone and opts.unprivileged and not opts.chroot
    assert opts.transport == "unix" and opts.args == []


def test_overrides_service_name_and_clustered_flags():
    opts = parse_argv(["qmgr", "-lu", "-n", "qmgr2", "-tunix", "-c",
                       "-o", "smtp_destination_concurrency_limit=7", "-oa = b c"])
    assert opts.service_name == "qmgr2" and opts.chroot and opts.alone
    assert opts.overrides == [("smtp_destination_concurrency_limit", "7"), ("a", "b c")]


def test_parsing_stops_at_first_non_option():
    opts = parse_argv(["qmgr", "-l", "extra", "-u"])
    assert opts.args == ["extra", "-u"] and not opts.unprivileged


def test_bad_options():
    with pytest.raises(UsageError):
        parse_argv(["qmgr", "-x"])
    with pytest.raises(UsageError):
        parse_argv(["qmgr", "-t"])


def test_generation_is_octal():
    assert generation_from_env({"GENERATION": "10"}) == 8
    with pytest.raises(UsageError, match="bad generation"):
        generation_from_env({"GENERATION": "x1"})


def test_malformed_override_gets_stocks_fatal_text():
    with pytest.raises(UsageError) as err:
        parse_argv(["qmgr", "-o", "novalue"])
    assert str(err.value) == ('invalid "-o novalue" option value: '
                              "missing '=' after attribute name")


def test_every_switch_sets_its_flag():
    opts = parse_argv(["qmgr", "-cdlSuV", "-vv"])
    assert (opts.chroot, opts.debug, opts.alone, opts.stand_alone, opts.unprivileged,
            opts.log_stderr, opts.verbose) == (True, True, True, True, True, True, 2)
    plain = parse_argv(["qmgr"])
    assert not (plain.chroot or plain.debug or plain.alone or plain.stand_alone
                or plain.unprivileged or plain.log_stderr or plain.verbose)
