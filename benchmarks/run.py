"""Run every benchmark (``./dev bench``); each compares pyqmgr with stock qmgr."""

from __future__ import annotations

import sys

from benchmarks import drain

if __name__ == "__main__":
    sys.exit(drain.main(sys.argv[1:]))
