"""Variable envelope return paths (``verp_sender.c``).

With VERP each delivery carries one recipient, and the sender ``prefix@origin`` becomes
``prefix+user=domain@origin`` (delimiters from the queue file's ``V`` record), built from
the original recipient when there is one, so bounces identify the recipient.
"""

from __future__ import annotations


def verp_sender(delimiters: str, sender: str, address: str, orig_addr: str) -> str:
    s_local, s_at, s_domain = sender.rpartition("@")
    if not s_at:
        s_local, s_domain = sender, ""
    recipient = orig_addr or address
    r_local, r_at, r_domain = recipient.rpartition("@")
    if not r_at:
        r_local, r_domain = recipient, ""
    out = s_local + delimiters[0] + r_local
    if r_domain:
        out += delimiters[1] + r_domain
    if s_domain:
        out += "@" + s_domain
    return out
