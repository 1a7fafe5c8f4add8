"""``authorized_mailq_users`` and its kin: which local users may do what (``user_acl.c``).

Postfix decides whether a local user may see the queue (``postqueue -p``) with
``check_user_acl_byuid()``: root and mail_owner are always allowed (postqueue checks
them first); an ACL that starts with ``static:`` allows everyone without looking the
user up (the default is ``static:anyone``); otherwise the uid's login name (or
``unknown`` when the password file has no entry for it) is matched against the ACL as
a string list (``match_list.c``): items separated by commas or white space, compared
case-insensitively, ``!`` before an item negates it, the first item that matches
decides and no match means refused.

pyqmgr reads the same parameter for its control channel, so that whoever may list the
queue may read the scheduler's state, and nobody else. Lookup tables (``hash:...``,
``ldap:...``) and ``/file/name`` items are not supported: the daemon answers from its
chroot after the privilege drop, where it cannot open the tables Postfix's postqueue
reads as the invoking user. Such an ACL is refused with a text that says so, and the
daemon then lets only root and mail_owner read (never everyone: a restriction the
admin wrote must not turn into none).
"""

from __future__ import annotations

import pwd
import re
from collections.abc import Callable
from dataclasses import dataclass

#: The parameter and Postfix's default for it (``DEF_SHOWQ_ACL``).
AUTHORIZED_MAILQ_USERS = "authorized_mailq_users"
DEFAULT_ACL = "static:anyone"

#: The name matched for a uid with no password file entry, as in Postfix.
UNKNOWN_USER = "unknown"

#: match_list.c's delimiters (CHARS_COMMA_SP).
_SPLIT = re.compile(r"[,\s]+")


class UserAclError(ValueError):
    """An ACL pyqmgr cannot evaluate: the text names the parameter and the item."""


@dataclass(frozen=True)
class UserAcl:
    """A parsed ACL: ``anyone``, or items of (match result, casefolded name or None).

    An item whose name is None is a ``static:`` table in the list: it matches every user.
    """

    param: str
    value: str
    anyone: bool
    items: tuple[tuple[bool, str | None], ...] = ()
    #: Texts Postfix would log as warnings while parsing (a ``#`` comment in the list).
    warnings: tuple[str, ...] = ()

    @classmethod
    def parse(cls, param: str, value: str) -> UserAcl:
        """Parse a parameter's value as Postfix's string list does; raise UserAclError.

        Only what pyqmgr can evaluate without opening files is accepted: login names,
        their negations, and ``static:`` (which matches everyone).
        """
        if value.startswith("static:"):
            # check_user_acl_byuid's shortcut: any static: ACL allows without a lookup.
            return cls(param, value, anyone=True)
        items: list[tuple[bool, str | None]] = []
        warnings: list[str] = []
        tokens = [t for t in _SPLIT.split(value) if t]
        for i, token in enumerate(tokens):
            if token.startswith("#"):
                rest = " ".join(tokens[i + 1:])
                warnings.append(f"{param}: comment at end of line is not supported: "
                                f"{token} {rest}".rstrip())
                break
            match = True
            item = token
            while item.startswith("!"):
                match = not match
                item = item[1:]
            if not item:
                raise UserAclError(f"{param}: no pattern after '!'")
            if item.startswith("/"):
                raise UserAclError(
                    f"{param} = {value}: the file pattern {item} is not supported by "
                    "pyqmgr's control channel (list the login names in main.cf instead)")
            if not item.startswith("[") and ":" in item:
                if item.startswith("static:"):
                    items.append((match, None))
                    continue
                raise UserAclError(
                    f"{param} = {value}: the lookup table {item} is not supported by "
                    "pyqmgr's control channel (only static:anyone and login names are); "
                    "only root and mail_owner may read the scheduler's state")
            items.append((match, item.casefold()))
        return cls(param, value, anyone=False, items=tuple(items),
                   warnings=tuple(warnings))

    def allows_name(self, name: str) -> bool:
        """Whether the login name passes the list (the first matching item decides)."""
        if self.anyone:
            return True
        folded = name.casefold()
        for match, item in self.items:
            if item is None or item == folded:
                return match
        return False

    def allows_uid(self, uid: int, *, mail_owner_uid: int | None,
                   name_of: Callable[[int], str | None] | None = None) -> bool:
        """postqueue's whole check: root, mail_owner, then the list by login name.

        ``name_of`` maps a uid to its login name (None when there is none); the default
        asks the password file now.
        """
        if uid == 0 or (mail_owner_uid is not None and uid == mail_owner_uid):
            return True
        if self.anyone:
            return True
        name = (name_of or login_name)(uid)
        return self.allows_name(name if name is not None else UNKNOWN_USER)

    def names(self) -> list[str]:
        """The login names the list mentions, to be resolved before a chroot."""
        return [item for _match, item in self.items if item is not None]


def login_name(uid: int) -> str | None:
    """The password file's name for ``uid``, or None (Postfix then matches "unknown")."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def configured_acl(lookup: Callable[[str], str | None], get: Callable[[str], str],
                   param: str = AUTHORIZED_MAILQ_USERS) -> UserAcl:
    """The ACL main.cf sets (``lookup`` raw, ``get`` expanded), Postfix's default if unset.

    A parameter set to the empty string stays empty, as in Postfix: nobody but root and
    mail_owner. Raises UserAclError for what pyqmgr cannot evaluate.
    """
    value = DEFAULT_ACL if lookup(param) is None else get(param)
    return UserAcl.parse(param, value)
