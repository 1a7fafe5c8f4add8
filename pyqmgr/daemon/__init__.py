"""The qmgr daemon that master(8) starts; ``main`` is the launcher's entry point."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    """Run as the qmgr service. Imports happen here, before any privilege drop."""
    from pyqmgr.daemon.startup import main as startup_main

    return startup_main(argv)
