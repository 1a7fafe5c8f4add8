"""docs/fleet.md and pyqmgr(8) against the code they describe (issue #35).

An operator copies the ACL line from docs/fleet.md into Redis's ACL file: a command
added to pyqmgr/fleet/acl.py and not to the docs would be refused (NOPERM) on every
fleet set up from them, with nothing in pyqmgr's tests to say why. So the docs' line
must be the code's, word for word, and every parameter of how to reach Redis must be
in both documents."""

from __future__ import annotations

import pathlib
import re

from pyqmgr.fleet.acl import acl_rules

ROOT = pathlib.Path(__file__).resolve().parents[2]
FLEET_MD = ROOT / "docs" / "fleet.md"
MAN = ROOT / "pyqmgr" / "man" / "pyqmgr.8"

#: pyqmgr.cf's parameters of how to reach the fleet's Redis.
CONNECTION_PARAMETERS = (
    "shared_state", "shared_state_user", "shared_state_password_file",
    "shared_state_sentinel_password_file", "shared_state_tls_ca_file",
    "shared_state_tls_cert_file", "shared_state_tls_key_file",
)
#: The address forms shared_state takes.
ADDRESS_FORMS = ("redis://", "rediss://", "unix:", "redis+sentinel://",
                 "rediss+sentinel://", "redis+cluster://", "rediss+cluster://")


def _acl_user_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("user pyqmgr on ")]


def test_the_docs_acl_lines_are_the_codes():
    lines = _acl_user_lines(FLEET_MD.read_text())
    assert lines, "docs/fleet.md has no 'user pyqmgr on ...' ACL line"
    rules = " ".join(acl_rules("pyqmgr:"))
    whole = [line for line in lines if not line.rstrip().endswith(("…", "(the line above)"))]
    assert whole, "no ACL line in docs/fleet.md is written out whole"
    for line in whole:
        # "user pyqmgr on #<sha256 ...> RULES": the password part is the operator's.
        quoted = re.sub(r"^user pyqmgr on (#<[^>]*>|>\S+) ", "", line).strip()
        assert quoted == rules, (
            f"docs/fleet.md's ACL line differs from pyqmgr/fleet/acl.py:\n"
            f"docs: {quoted}\ncode: {rules}")


def test_every_connection_parameter_and_address_form_is_documented():
    fleet_md = FLEET_MD.read_text()
    # roff escapes hyphens and may hold words apart with \%: compare plain text.
    man = MAN.read_text().replace("\\%", "").replace("\\-", "-")
    for name in CONNECTION_PARAMETERS:
        assert f"`{name}`" in fleet_md, f"{name} is not in docs/fleet.md's table"
        assert f"\\fB{name}\\fR" in man, f"{name} is not in pyqmgr(8)"
    for form in ADDRESS_FORMS:
        assert form in fleet_md, f"{form} is not in docs/fleet.md"
        assert form in man, f"{form} is not in pyqmgr(8)"
