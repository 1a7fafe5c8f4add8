"""The server skeletons' getopt("+..."): one parser for qmgr's argv and master.cf commands."""

import getopt as std_getopt

from hypothesis import given
from hypothesis import strategies as st

from pyqmgr.postfix.getopt import MISSING_ARGUMENT, SERVER_OPTIONS, UNKNOWN, GetOpt


def run(args, optind=0):
    options = GetOpt(args, optind=optind)
    return list(options), options.optind


def test_clustered_flags_and_attached_or_detached_values():
    assert run(["-lu", "-tunix", "-n", "qmgr2", "-o", "a=b", "-oc=d", "rest"]) == (
        [("l", None), ("u", None), ("t", "unix"), ("n", "qmgr2"), ("o", "a=b"),
         ("o", "c=d")], 7)


def test_a_value_ends_its_cluster():
    assert run(["-lto", "-u"]) == ([("l", None), ("t", "o"), ("u", None)], 2)


def test_first_non_option_dash_or_double_dash_ends_the_options():
    assert run(["-l", "x", "-u"]) == ([("l", None)], 1)
    assert run(["-l", "-", "-u"]) == ([("l", None)], 1)
    assert run(["-l", "--", "-u"]) == ([("l", None)], 2)  # "--" is consumed


def test_unknown_letters_are_reported_and_the_scan_goes_on():
    assert run(["-xl", "-:", "-u"]) == ([(UNKNOWN, "x"), ("l", None), (UNKNOWN, ":"),
                                         ("u", None)], 3)


def test_missing_argument_ends_the_scan():
    assert run(["-l", "-t"]) == ([("l", None), (MISSING_ARGUMENT, "t")], 2)


def test_optind_start_skips_the_program_name():
    assert run(["qmgr", "-l"], optind=1) == ([("l", None)], 2)


WORDS = st.sampled_from(["-l", "-lu", "-uv", "-t", "unix", "-tunix", "-o", "a=b", "-oa=b",
                         "-n", "x", "--", "-", "-x", "-lx", "-:", "", "-lo", "-ot"])


@given(st.lists(WORDS, max_size=8))
def test_agrees_with_posix_getopt(args):
    """Python's getopt.getopt() is POSIX getopt without permutation, as "+" asks."""
    got, optind = run(args)
    try:
        expected, rest = std_getopt.getopt(args, SERVER_OPTIONS)
    except std_getopt.GetoptError:
        assert any(letter in (UNKNOWN, MISSING_ARGUMENT) for letter, _ in got)
        return
    assert [(f"-{letter}", value or "") for letter, value in got] == expected
    assert args[optind:] == rest
