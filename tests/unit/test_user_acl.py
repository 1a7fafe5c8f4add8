"""authorized_mailq_users as Postfix evaluates it (user_acl.c, match_list.c), so that the
control channel lets read exactly the users postqueue -p lets list the queue."""

from __future__ import annotations

import pytest

from pyqmgr.postfix.config import QmgrConfig
from pyqmgr.postfix.user_acl import DEFAULT_ACL, UserAcl, UserAclError, configured_acl

NAMES = {0: "root", 100: "postfix", 1000: "alice", 1001: "bob", 1002: "Carol"}


def allows(value: str, uid: int, mail_owner_uid: int | None = 100) -> bool:
    acl = UserAcl.parse("authorized_mailq_users", value)
    return acl.allows_uid(uid, mail_owner_uid=mail_owner_uid, name_of=NAMES.get)


def test_default_allows_everyone_even_without_a_passwd_entry():
    assert allows(DEFAULT_ACL, 1000) and allows(DEFAULT_ACL, 4242)


def test_any_static_acl_is_postfixs_shortcut():
    assert allows("static:whatever", 1001)


def test_list_of_names():
    value = "alice, root"
    assert allows(value, 1000)
    assert not allows(value, 1001)


def test_whitespace_and_commas_both_separate():
    assert allows("root\tbob ,alice", 1001)


def test_root_and_mail_owner_always_allowed():
    assert allows("alice", 0)
    assert allows("alice", 100)
    assert allows("", 0) and allows("", 100)
    assert not allows("alice", 100, mail_owner_uid=None)


def test_empty_list_allows_nobody_else():
    assert not allows("", 1000)


def test_names_compare_case_insensitively():
    assert allows("ALICE", 1000)
    assert allows("carol", 1002)


def test_negation_and_first_match_decides():
    assert not allows("!bob, static:anyone", 1001)
    assert allows("!bob, static:anyone", 1000)
    assert allows("bob, !bob", 1001)
    assert allows("!!bob", 1001), "two negations cancel"


def test_uid_without_a_name_is_unknown():
    assert allows("unknown", 4242)
    assert not allows("!unknown, static:anyone", 4242)


def test_comment_stops_the_list_with_a_warning():
    acl = UserAcl.parse("authorized_mailq_users", "alice #bob")
    assert acl.names() == ["alice"]
    assert acl.warnings == ("authorized_mailq_users: comment at end of line is not "
                            "supported: #bob",)


@pytest.mark.parametrize("value, item", [("hash:/etc/postfix/mailq_users", "hash:"),
                                         ("alice, ldap:/etc/postfix/ldap.cf", "ldap:")])
def test_lookup_tables_are_refused_with_a_clear_text(value, item):
    with pytest.raises(UserAclError) as info:
        UserAcl.parse("authorized_mailq_users", value)
    text = str(info.value)
    assert text.startswith(f"authorized_mailq_users = {value}: the lookup table {item}")
    assert "not supported" in text and "only root and mail_owner" in text


def test_file_patterns_are_refused():
    with pytest.raises(UserAclError, match="file pattern /etc/x is not supported"):
        UserAcl.parse("authorized_mailq_users", "/etc/x")


def test_bare_negation_is_an_error():
    with pytest.raises(UserAclError, match="no pattern after '!'"):
        UserAcl.parse("authorized_mailq_users", "alice, !")


def test_from_main_cf_default_when_unset_and_empty_when_set_empty():
    unset = QmgrConfig.from_text("")
    assert configured_acl(unset.lookup, unset.get).anyone
    empty = QmgrConfig.from_text("authorized_mailq_users =\n")
    assert not configured_acl(empty.lookup, empty.get).anyone
    expanded = QmgrConfig.from_text("admins = alice bob\nauthorized_mailq_users = $admins\n")
    assert configured_acl(expanded.lookup, expanded.get).names() == ["alice", "bob"]
