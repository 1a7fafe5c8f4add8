"""Reading a settings file whole, with a ceiling (tables, rules files).

Every file pyqmgr reads at start-up is read whole, and none may be larger than its
ceiling: a file cut at the limit would be half a table, and one read unbounded could
exhaust memory. One reader, so that every such file is refused the same way.
"""

from __future__ import annotations


class TooLarge(ValueError):
    """The file is larger than its ceiling."""


def read_bounded(path: str, limit: int) -> bytes:
    """The file's bytes; OSError when it cannot be read, TooLarge beyond ``limit``."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(f"{path}: larger than {limit} bytes")
    return data
