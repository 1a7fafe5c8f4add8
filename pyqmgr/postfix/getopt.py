"""The C library's ``getopt()`` as Postfix's server skeletons call it (``"+..."``).

Two places read a server's command line this way: the daemon's own argv from master(8)
(:mod:`pyqmgr.postfix.master`), and the commands of other services in master.cf, whose
``-o`` overrides decide their transport parameters (:mod:`pyqmgr.postfix.master_cf`).
They must agree with each other and with the real skeleton on what counts as an option,
so both iterate this one parser and differ only in what they do with a bad option.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

#: Options of Postfix's server skeletons; those that take an argument are followed by ':'.
SERVER_OPTIONS = "cdDi:lm:n:o:s:St:uvVz"

#: What the iteration yields in place of a letter for an option not in the optstring,
#: and for an option whose argument is missing (glibc's '?' and ':').
UNKNOWN = "?"
MISSING_ARGUMENT = ":"


class GetOpt:
    """Iterate over ``(letter, value)``; afterwards ``optind`` is the first operand.

    As glibc with a leading ``+`` in the optstring: no permutation, so the first word
    that is not an option (or is ``-``) ends the options, and ``--`` ends them and is
    consumed. Clustered flags (``-lu``) and attached or detached values (``-tunix``,
    ``-t unix``) are the same. An unknown letter yields ``(UNKNOWN, letter)`` and the
    scan goes on; a missing argument yields ``(MISSING_ARGUMENT, letter)`` and ends it.
    ``optind`` is only meaningful once the iteration has run to its end.
    """

    def __init__(self, args: Sequence[str], optstring: str = SERVER_OPTIONS,
                 optind: int = 0) -> None:
        self.args = args
        self.optstring = optstring
        self.optind = optind

    def __iter__(self) -> Iterator[tuple[str, str | None]]:
        args = self.args
        optstring = self.optstring
        i = self.optind
        while i < len(args):
            word = args[i]
            if word == "--":
                i += 1
                break
            if not word.startswith("-") or word == "-":
                break
            j = 1
            while j < len(word):
                letter = word[j]
                pos = optstring.find(letter)
                if pos < 0 or letter == ":":
                    yield UNKNOWN, letter
                    j += 1
                    continue
                if optstring[pos + 1:pos + 2] != ":":
                    yield letter, None
                    j += 1
                    continue
                if j + 1 < len(word):
                    value = word[j + 1:]
                else:
                    i += 1
                    if i >= len(args):
                        self.optind = i
                        yield MISSING_ARGUMENT, letter
                        return
                    value = args[i]
                yield letter, value
                break
            i += 1
        self.optind = i
