"""The fleet user's ACL (pyqmgr/fleet/acl.py): the words Redis reads, the prefix taken
literally. That Redis enforces it as meant is tests/test_testbed_redis.py's and
tests/test_fleet_deployments_real.py's, on real servers."""

from __future__ import annotations

import pytest

from pyqmgr.fleet.acl import ACL_COMMANDS, acl_rules, acl_setuser


def test_rules_hold_the_user_to_its_prefix_and_commands():
    rules = acl_rules("pyqmgr:")
    assert rules[:5] == ["resetkeys", "~pyqmgr:*", "resetchannels", "&pyqmgr:*", "-@all"]
    assert rules[5:] == [f"+{c}" for c in ACL_COMMANDS]
    assert list(ACL_COMMANDS) == sorted(set(ACL_COMMANDS))
    for never in ("keys", "scan", "flushall", "flushdb", "config", "script|flush",
                  "debug", "monitor", "shutdown", "acl", "@all", "client|kill"):
        assert never not in ACL_COMMANDS, never


def test_glob_characters_in_a_prefix_are_literal():
    assert acl_rules("a*b?[c]\\:")[1] == "~a\\*b\\?\\[c\\]\\\\:*"


@pytest.mark.parametrize("prefix", ["", "two words", "tab\t"])
def test_a_prefix_is_one_word(prefix):
    with pytest.raises(ValueError):
        acl_rules(prefix)


def test_the_setuser_line_for_the_docs():
    line = acl_setuser("relay", "fleet1:", "s3cret")
    assert line.startswith("ACL SETUSER relay on >s3cret resetkeys ~fleet1:* ")
    assert line.endswith(" +zscore")
