"""Parity suite fixtures: one report per session, written where PYQMGR_PARITY_REPORT says.

``./dev test`` sets PYQMGR_PARITY_REPORT=compat/parity.md, so a full run regenerates the
committed report; a partial run (``-k``) writes only when the variable is set.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from compat.parity import Report, Result, Scenario, compare
from pyqmgr.testbed.instance import PostfixInstance

_REPORT = Report()


@pytest.fixture(scope="session")
def parity_report() -> Iterator[Report]:
    _REPORT.postfix = _postfix_release()
    _REPORT.build = _qmgr_build()
    yield _REPORT
    path = os.environ.get("PYQMGR_PARITY_REPORT")
    if path and _REPORT.results:
        with open(path, "w", encoding="utf-8") as f:
            f.write(_REPORT.render())


def _postfix_release() -> str:
    """The release the instances run: the selected root's, or the machine's own."""
    import subprocess

    from pyqmgr.testbed.release import ReleaseRoot, selected

    name = selected()
    if name is not None:
        return ReleaseRoot(name).version()
    return subprocess.run(["postconf", "-dh", "mail_version"], capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip()


def _qmgr_build() -> str:
    """The build the instances' pyqmgr runs, asked of the interpreter the qmgr service
    will run; ``./dev test-compiled`` must be running the compiled one."""
    import subprocess
    import sys

    from pyqmgr.testbed.instance import QMGR_PYTHON_ENV

    python = os.environ.get(QMGR_PYTHON_ENV) or sys.executable
    build = subprocess.run([python, "-I", "-c", "import pyqmgr.build as b; print(b.name())"],
                           capture_output=True, text=True, check=True,
                           timeout=60).stdout.strip()
    if os.environ.get("PYQMGR_EXPECT_BUILD") and \
            not build.startswith(os.environ["PYQMGR_EXPECT_BUILD"]):
        pytest.exit(f"the parity suite was to run pyqmgr's {os.environ['PYQMGR_EXPECT_BUILD']}"
                    f" build, and {python} runs the {build} one", returncode=1)
    return build


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests marked ``oqmgr`` run a second time: Postfix's oqmgr against the policy."""
    if ("parity_reference" in metafunc.fixturenames
            and metafunc.definition.get_closest_marker("oqmgr") is not None):
        metafunc.parametrize("parity_reference", ["stock", "oqmgr"])


@pytest.fixture
def parity_reference() -> str:
    """The qmgr pyqmgr is compared with: stock qmgr unless the test is marked oqmgr."""
    return "stock"


@pytest.fixture
def side_by_side(postfix_instance: Callable[..., PostfixInstance],
                 parity_report: Report, parity_reference: str) -> Callable[..., Result]:
    """``side_by_side(scenario, name=, item=, description=, **instance_kw)``.

    Runs the scenario under both qmgrs, records the result in the report, and fails
    the test when the outcomes differ (unless ``intended=`` names why they may).
    """

    def run(scenario: Scenario, **kw: Any) -> Result:
        result = compare(scenario, postfix_instance, reference=parity_reference, **kw)
        parity_report.add(result)
        if result.intended is None:
            assert result.agree, f"{parity_reference} and pyqmgr differ:\n{result.diff()}"
        return result

    return run
