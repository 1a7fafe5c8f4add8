"""One domain's MX records, asked with dnspython, bounded (issues #33, #44).

What a lookup returns is raw: the (preference, host) records, how long the answer
holds, and why it failed. Naming the site from the records (:func:`site_name`) is
the caller's: the lookup helper process (:mod:`pyqmgr.daemon.site_lookupd`) runs
this and sends the records to qmgr, which names the site with its provider table;
qmgr runs it itself only when the helper is gone (:mod:`pyqmgr.daemon.sites`).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

#: What one lookup found: the MX records (preference, host; None: no MX, the domain
#: is its own site, or the lookup failed), how long the answer holds, and why it
#: failed (None: it did not). A null MX (``MX 0 .``) is the host ``"."``.
Records = list[tuple[int, str]]
MxFound = tuple[Records | None, float, str | None]


class MxLookup:
    """dnspython's asyncio resolver, made now (it reads /etc/resolv.conf: before the
    chroot or the helper's privilege drop), asked for MX records with a bounded
    lifetime.

    Made as root: dnspython imports its asyncio backend at the first lookup and each
    record type's class at the first answer holding one, and after a privilege drop
    those files may be out of reach (a checkout under /root, a chroot): every lookup
    failed (issue #43). So the backend is taken now and every record type loaded
    (15 ms, 1 MiB), which also stops dnspython from importing at all later: a record
    type nobody expected in an answer's additional section is read as generic data,
    not imported as mail_owner.
    """

    def __init__(self, timeout: float, negative_ttl: float) -> None:
        import dns.asyncbackend
        import dns.asyncresolver
        import dns.exception
        import dns.rdata
        import dns.resolver

        dns.asyncbackend.set_default_backend("asyncio")
        dns.rdata.load_all_types()
        self.timeout = timeout
        self.negative_ttl = negative_ttl
        self.resolver = dns.asyncresolver.Resolver()

    async def mx(self, domain: str) -> MxFound:
        import dns.exception
        import dns.resolver

        began = time.monotonic()
        quick = await self._quick(domain)
        if quick is not None:
            return quick
        lifetime = self.timeout - (time.monotonic() - began)
        failed = self.negative_ttl
        if lifetime <= 0:
            return None, failed, f"timeout after {self.timeout:g}s"
        try:
            answer = await self.resolver.resolve(domain, "MX", lifetime=lifetime,
                                                 search=False)
        except dns.resolver.NXDOMAIN:
            return None, failed, "NXDOMAIN"
        except dns.resolver.NoAnswer:
            # No MX: smtp(8) delivers to the domain's own address; it is its own site.
            return None, failed, None
        except dns.resolver.LifetimeTimeout:
            return None, failed, f"timeout after {self.timeout:g}s"
        except dns.resolver.NoNameservers as exc:
            return None, failed, f"no server answered: {_short(exc)}"
        except dns.exception.DNSException as exc:
            return None, failed, f"{type(exc).__name__}: {_short(exc)}"
        records = _records(answer)
        ttl = float(answer.rrset.ttl) if answer.rrset is not None else failed
        return records, ttl, None

    async def _quick(self, domain: str) -> MxFound | None:
        """The common case at about half the resolver's CPU: one MX query to the
        first name server, over a UDP socket of its own, the answer read by dnspython.

        A new domain costs one lookup, and the resolver's machinery around the
        query (an asyncio endpoint a query, its futures and retries) took 275-350 us
        of CPU; a query of our own took 175-195 with dnspython building the query and
        asyncio's sock_recv under a timeout, and 150-160 now that the query's few
        bytes are written here and the answer is checked in the socket's own reader
        callback (#44; tests/test_sites_dns.py measures both). Anything but a plain
        answer (truncated, an error other than NXDOMAIN, a CNAME, the server silent
        within its timeout, a name server that is not an address, a name that is not
        plain ASCII) returns None, and the resolver asks as before. The answer is
        checked as dnspython's own query checks it (the ID, the question, from the
        connected server's address, the source port the kernel's random pick)."""
        servers = self.resolver.nameservers
        if not servers or not isinstance(servers[0], str):
            return None
        query = mx_query(domain)
        if query is None:
            return None
        wire, question = query
        address, port = servers[0], self.resolver.port
        loop = asyncio.get_running_loop()
        got: asyncio.Future[Any] = loop.create_future()
        try:
            sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET,
                                 socket.SOCK_DGRAM)
        except OSError:
            return None
        with sock:
            sock.setblocking(False)
            fd = sock.fileno()

            def readable() -> None:
                # Reads on past what is not the answer (garbage, another ID, another
                # question), as dnspython does; the first answer ends the wait.
                while not got.done():
                    try:
                        data = sock.recv(65535)
                    except BlockingIOError:
                        return
                    except OSError:
                        got.set_result(None)
                        return
                    reply = answer_to(data, wire, question)
                    if reply is not None:
                        got.set_result(reply)

            try:
                sock.connect((address, port))
                sock.send(wire)  # a datagram: sent whole or not at all
            except OSError:
                return None
            loop.add_reader(fd, readable)
            expired = False

            def expire() -> None:
                nonlocal expired
                expired = True
                got.cancel()

            timer = loop.call_later(min(self.timeout, self.resolver.timeout), expire)
            try:
                reply = await got
            except asyncio.CancelledError:
                if not expired:  # cancelled from outside (shutdown): not the timeout
                    raise
                return None
            finally:
                timer.cancel()
                loop.remove_reader(fd)
        if reply is None:
            return None
        return found_in(reply, self.negative_ttl)


#: The header of an MX query: recursion desired, one question (the ID goes first).
_QUERY_FLAGS = b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
#: The question's type and class: MX, IN.
_MX_IN = b"\x00\x0f\x00\x01"


def mx_query(domain: str) -> tuple[bytes, bytes] | None:
    """An MX query for a plain ASCII domain (its wire and its question section), or
    None for anything else (an IDN, an empty or overlong label): dnspython's
    resolver asks for those. The ID is 16 random bits, as dnspython's."""
    try:
        labels = domain.rstrip(".").encode("ascii").lower().split(b".")
    except UnicodeEncodeError:
        return None
    if sum(len(label) + 1 for label in labels) > 254 or not all(
            0 < len(label) < 64 for label in labels):
        return None
    question = b"".join(bytes((len(label),)) + label for label in labels) + b"\x00" + _MX_IN
    return os.urandom(2) + _QUERY_FLAGS + question, question


def answer_to(data: bytes, wire: bytes, question: bytes) -> Any:
    """The datagram read as the answer to this query (dnspython's Message), or None:
    another ID, not a response, another opcode or question, not a DNS message."""
    import dns.exception
    import dns.message

    end = 12 + len(question)
    if (len(data) < end or data[:2] != wire[:2] or not data[2] & 0x80
            or data[2] & 0x78 or data[4:6] != b"\x00\x01"
            or data[12:end].lower() != question):
        return None
    try:
        return dns.message.from_wire(data)
    except dns.exception.DNSException:
        return None


def found_in(reply: Any, negative_ttl: float) -> MxFound | None:
    """What an answer says, or None: truncated, an error but NXDOMAIN, a CNAME."""
    import dns.flags
    import dns.rcode
    import dns.rdataclass
    import dns.rdatatype

    if reply.flags & dns.flags.TC:
        return None
    rcode = reply.rcode()
    if rcode == dns.rcode.NXDOMAIN:
        return None, negative_ttl, "NXDOMAIN"
    if rcode != dns.rcode.NOERROR:
        return None
    name = reply.question[0].name
    for rrset in reply.answer:
        if (rrset.rdtype == dns.rdatatype.MX and rrset.rdclass == dns.rdataclass.IN
                and rrset.name == name):
            return _records(rrset), float(rrset.ttl), None
    if reply.answer:
        return None  # a CNAME: the resolver follows it
    return None, negative_ttl, None  # no MX: the domain's own site


def _records(rrset: Any) -> Records:
    """The records in dnspython's text form, which escapes every byte that is not
    printable ASCII or is a space (\\DDD), so a host never holds whitespace; the root
    (a null MX) is ``"."``."""
    return [(int(r.preference), r.exchange.to_text(omit_final_dot=True) or ".")
            for r in rrset]


def _short(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:197] + "..."
