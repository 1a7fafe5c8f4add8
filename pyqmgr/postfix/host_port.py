"""``host:port`` and ``[address]:port``, as Postfix's host_port() splits them.

The address in brackets is how Postfix writes an IPv6 address (or any address that
must not be looked up), and a bare host with a colon in it is refused, since the
port could not be told from the address. Used for policy services
(``inet:host:port``) and the fleet's Redis (``redis://host:port``); each caller says
what the text was in its own words.
"""

from __future__ import annotations


class HostPortError(ValueError):
    """What is wrong: ``bracket`` (no ``]:`` after ``[``), ``colon`` (no port),
    ``ipv6`` (an unbracketed host with a colon) or ``host`` (an empty host)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def host_port(address: str) -> tuple[str, str]:
    """(host, port text); the port text is not checked here."""
    if address.startswith("["):
        host, bracket, tail = address[1:].partition("]")
        if not bracket or not tail.startswith(":"):
            raise HostPortError("bracket")
        port_text = tail[1:]
    else:
        host, colon, port_text = address.rpartition(":")
        if not colon:
            raise HostPortError("colon")
        if ":" in host:
            raise HostPortError("ipv6")
    if not host:
        raise HostPortError("host")
    return host, port_text
