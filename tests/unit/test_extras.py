"""pyqmgr.extras: which settings need an extra, and the command that installs one.

The fresh-venv half (no extra installed at all, on real Postfix) is
tests/test_base_install.py; here the rules themselves, in this venv (every extra in).
"""

from __future__ import annotations

import os
import sys

import pytest

from pyqmgr import extras
from pyqmgr.extras import FEATURES, install_command, lacking, lacking_fatal, lacking_texts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_from_this_checkout_the_command_names_it_and_this_venvs_pip():
    """An editable install or a run from the checkout: the checkout's path, which works
    from any directory ('.[sites]' only from inside it)."""
    pip = os.path.join(sys.prefix, "bin", "pip")
    assert install_command(["sites"]) == f"{pip} install '{ROOT}[sites]'"
    assert install_command(["metrics", "sites"]).endswith(f"'{ROOT}[metrics,sites]'")


def test_from_a_package_the_command_names_the_distribution(monkeypatch):
    monkeypatch.setattr(extras, "_checkout", lambda: None)
    assert install_command(["fleet"]).endswith(" install 'pyqmgr[fleet]'")


@pytest.mark.parametrize("values, on", [
    ({}, []),
    ({"metrics_listen": ""}, []),
    ({"metrics_listen": "9155"}, ["metrics_listen"]),
    ({"site_grouping": "none"}, []),
    ({"site_grouping": "MX"}, ["site_grouping"]),
    ({"message_classes": "transactional"}, []),  # one class needs no file events
    ({"message_classes": "transactional, bulk"}, ["message_classes"]),
    ({"shared_state": " "}, []),
    ({"shared_state": "redis://127.0.0.1:6379"}, ["shared_state"]),
])
def test_which_values_turn_a_feature_on(values, on, monkeypatch):
    """What start-up would import for: lacking() names exactly those when none of the
    libraries is installed."""
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda name: None)
    assert [f.parameter for f in lacking(values)] == on


def test_installed_libraries_are_not_lacking():
    every = {"metrics_listen": "9155", "site_grouping": "mx",
             "message_classes": "a b", "shared_state": "redis://127.0.0.1:6379"}
    assert lacking(every) == []


def test_one_fatal_line_names_every_missing_extra_and_one_command(monkeypatch):
    monkeypatch.setattr(extras, "_checkout", lambda: None)
    metrics, sites = FEATURES[0], FEATURES[1]
    assert lacking_texts("/etc/postfix/pyqmgr.cf", [sites]) == [lacking_fatal(
        "/etc/postfix/pyqmgr.cf", [sites])]
    text = lacking_fatal("/etc/postfix/pyqmgr.cf", [metrics, sites])
    assert text.startswith("/etc/postfix/pyqmgr.cf: parameters metrics_listen, "
                           "site_grouping: need the metrics, sites extras "
                           "(prometheus-client, dnspython), which are not installed: ")
    assert text.endswith(" install 'pyqmgr[metrics,sites]'")
