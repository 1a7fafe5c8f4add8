"""Fixtures that start real Postfix instances and sink servers, and always stop them."""

from __future__ import annotations

import pytest

from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import SinkServer


@pytest.fixture
def postfix():
    """Factory: ``postfix(qmgr="pyqmgr", transports=..., main_cf=...)`` -> started instance."""
    made: list[PostfixInstance] = []

    def make(start: bool = True, **kw) -> PostfixInstance:
        inst = PostfixInstance(**kw)
        made.append(inst)
        if start:
            inst.start()
        return inst

    yield make
    errors = []
    for inst in made:
        try:
            inst.close()
        except Exception as exc:  # keep closing the others
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def sink():
    made: list[SinkServer] = []

    def make(**kw) -> SinkServer:
        server = SinkServer(**kw).start()
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()
