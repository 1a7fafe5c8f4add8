"""Fixtures that start real Postfix instances and sink servers, and always stop them.

Tests that use ``postfix_instance`` need root and Debian's postfix package (CI runs as
root); they are skipped with a clear reason elsewhere rather than failing obscurely.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Callable, Iterator

import pytest

from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.redis import RedisServer
from pyqmgr.testbed.redis import available as redis_available
from pyqmgr.testbed.sink import SinkServer
from tests.trust_helpers import PyqmgrForOthers
from tests.trust_helpers import pyqmgr_for_others as _pyqmgr_for_others
from tests.trust_helpers import trusted_dir as _trusted_dir

#: Tests that may skip in CI (``CI=true``), each with why. Anything else that skips there
#: fails: a suite must not pass by not running. Empty: every test runs in CI.
ALLOWED_SKIPS: dict[str, str] = {}


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """In CI, a skip not listed in ALLOWED_SKIPS is reported as a failure, with its reason."""
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and _in_ci() and not hasattr(report, "wasxfail")
            and item.nodeid.split("[")[0] not in ALLOWED_SKIPS
            and item.nodeid not in ALLOWED_SKIPS):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (f"skipped in CI ({reason}); CI runs every test: install what it "
                           "needs in ./dev, or list it in tests/conftest.py ALLOWED_SKIPS "
                           "with the reason")


_NO_POSTFIX = None
if os.geteuid() != 0:
    _NO_POSTFIX = "needs root to run a Postfix instance"
elif shutil.which("postfix") is None or not os.path.exists("/usr/share/postfix/master.cf.dist"):
    _NO_POSTFIX = "needs Debian's postfix package"


@pytest.fixture
def postfix_instance() -> Iterator[Callable[..., PostfixInstance]]:
    """Factory: ``postfix_instance(qmgr="pyqmgr", transports=..., start=True)``.

    Every instance made is stopped and removed at teardown, even when the test failed
    (set PYQMGR_KEEP_TESTBED=1 to keep the directories for a post-mortem).
    """
    if _NO_POSTFIX:
        pytest.skip(_NO_POSTFIX)
    made: list[PostfixInstance] = []

    def make(start: bool = True, **kw: object) -> PostfixInstance:
        inst = PostfixInstance(**kw)  # type: ignore[arg-type]
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
def postfix(postfix_instance: Callable[..., PostfixInstance]) -> Callable[..., PostfixInstance]:
    """The same factory under its older, shorter name."""
    return postfix_instance


@pytest.fixture
def redis_server() -> Iterator[Callable[..., RedisServer]]:
    """Factory: ``redis_server(password=None)`` -> a started redis-server on loopback;
    every one made is stopped and its directory removed at teardown."""
    if not redis_available():
        pytest.skip("needs Debian's redis-server (./dev installs it)")
    made: list[RedisServer] = []

    def make(**kw: object) -> RedisServer:
        server = RedisServer(**kw)  # type: ignore[arg-type]
        made.append(server)
        return server.start()

    yield make
    for server in made:
        server.stop()


@pytest.fixture
def sink() -> Iterator[Callable[..., SinkServer]]:
    """Factory: ``sink(latency=..., replies=..., client_limit=...)`` -> started sink."""
    made: list[SinkServer] = []

    def make(**kw: object) -> SinkServer:
        server = SinkServer(**kw).start()  # type: ignore[arg-type]
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


@pytest.fixture(scope="session")
def pyqmgr_for_others() -> Iterator[PyqmgrForOthers]:
    """pyqmgr as users other than root run it: a copy of the working tree's package
    they can read, with Debian's python3 (tests/trust_helpers.py). The suite's checkout
    may be under a 0700 directory such as /root; an admin's users run an installation
    under /opt (README section 6). Made once a session, removed at its end."""
    with _pyqmgr_for_others() as made:
        yield made


@pytest.fixture
def tables_dir() -> Iterator[pathlib.Path]:
    """A directory (0755) for the tables and rules files a test's pyqmgr.cf names. The
    daemon reads them as root and refuses any on a path others can change
    (trust.RootFiles): pytest's tmp_path lies under /tmp, which anyone can write, so
    such files go here, under a root-only parent (tests/trust_helpers.py)."""
    with _trusted_dir("pyqmgr-tables-") as path:
        yield pathlib.Path(path)
