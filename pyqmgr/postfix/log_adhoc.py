"""Per-recipient status lines that qmgr writes itself (``log_adhoc.c``, ``format_tv.c``).

Normally delivery agents log ``to=<...>, status=...`` lines, but when qmgr defers or
discards a recipient on its own (dead destination with the retry service also dead, the
double-bounce discard) it writes the same line. pflogsumm and admins' scripts read the
delay fields, so their odd formatting (two significant digits below one second, whole
seconds above ten) is reproduced exactly.
"""

from __future__ import annotations

from pyqmgr.postfix.resolve import quote_822_local

MILLION = 1_000_000


def format_tv(sec: int, usec: int, sig_dig: int = 2, max_dig: int = 2) -> str:
    """Round a duration to ``sig_dig`` significant digits, ``max_dig`` decimals at most."""
    ures = MILLION // 10**max_dig
    wid = 10**sig_dig
    if ures < MILLION:
        if sec > 0:
            n = 1
            while sec >= n and n <= wid // 10:
                n *= 10
            ures = (MILLION // wid) * n
        else:
            while usec >= wid * ures:
                ures *= 10
    if ures > 1:
        usec += ures // 2
        if usec >= MILLION:
            sec += 1
            usec -= MILLION
    out = str(sec)
    if usec >= ures:
        digits = []
        rem = usec
        n = MILLION // 10
        while rem >= ures and n > 0:
            digits.append("0123456789"[rem // n])
            rem %= n
            n //= 10
        out += "." + "".join(digits)
    return out


def _delta(later: tuple[int, int], earlier: tuple[int, int]) -> tuple[int, int]:
    sec = later[0] - earlier[0]
    usec = later[1] - earlier[1]
    while usec < 0:
        usec += MILLION
        sec -= 1
    while usec >= MILLION:
        usec -= MILLION
        sec += 1
    if sec < 0:
        return 0, 0
    return sec, usec


def log_adhoc_line(
    queue_id: str, address: str, orig_addr: str, relay: str,
    incoming: tuple[int, int], active: tuple[int, int], now: tuple[int, int],
    dsn_status: str, status: str, reason: str, max_res: int = 2,
) -> str:
    """The ``to=<...>, relay=..., delay=..., delays=a/b/c/d, dsn=..., status=...`` text.

    Only the "no delivery agent" shape is needed by qmgr: c and d are zero and b runs
    from activation to now.
    """
    text = f"{queue_id}: to=<{quote_822_local(address)}>"
    if orig_addr and orig_addr.lower() != address.lower():
        text += f", orig_to=<{quote_822_local(orig_addr)}>"
    text += f", relay={relay}"
    delay = _delta(now, incoming)
    if active[0] > 0:
        pdelay = _delta(active, incoming)
        adelay = _delta(now, active)
    else:
        pdelay = _delta(now, incoming)
        adelay = (0, 0)

    def fmt(d: tuple[int, int]) -> str:
        return format_tv(d[0], d[1], 2, max_res)

    text += (
        f", delay={fmt(delay)}, delays={fmt(pdelay)}/{fmt(adelay)}/0/0"
        f", dsn={dsn_status}, status={status} ({reason})"
    )
    return text
