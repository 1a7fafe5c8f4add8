"""Source pools' settings (pyqmgr/settings/sources.py): each mistake is one fatal line
naming the parameter; a good file makes the core's book."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyqmgr.pyqmgr_cf import PyqmgrCfError, from_text
from pyqmgr.pyqmgr_cf_names import unknown_parameters
from pyqmgr.scheduler.source import HOUR, WARM
from pyqmgr.settings.sources import parse_start, source_settings

COMMANDS = {"smtp": "smtp", "src1": "smtp", "src2": "smtp", "src3": "lmtp",
            "local": "local", "relay": "smtp"}
GOOD = """source_pools = bulk, tx
bulk_sources = src1 src2:3
tx_sources = src3
source_pool_maps = inline:{ bulk=bulk, transactional=tx, acme=tx }
"""


def settings(text: str):  # type: ignore[no-untyped-def]
    return source_settings(from_text(text, "/etc/postfix/pyqmgr.cf"), COMMANDS)


def test_off_without_pools() -> None:
    assert settings("site_grouping = mx\n") is None


def test_good_settings_make_the_book(tmp_path: Path) -> None:
    plan = tmp_path / "warmup"
    plan.write_text("window hour\n0 50\n10 warm\n")
    got = settings(GOOD + f"source_warmup_plan = {plan}\n"
                          "src1_source_warmup_start = 2026-11-20\n")
    assert got is not None
    assert got.pools == {"bulk": (("src1", 1), ("src2", 3)), "tx": (("src3", 1),)}
    assert got.transports == frozenset({"smtp"})
    assert got.plan is not None and got.plan.window == HOUR
    assert got.plan.steps == ((0, 50), (10, WARM))
    assert got.starts == {"src1": parse_start("2026-11-20")}
    assert got.pool_for("acme", "bulk") == "tx"  # the tenant first
    assert got.pool_for("other", "bulk") == "bulk"
    assert got.pool_for("other", "default") is None
    book = got.book()
    assert book.pools["bulk"].weights == (1, 3)


@pytest.mark.parametrize("extra, fatal", [
    ("bulk_sources = src1 srcx\n", 'bulk_sources: "srcx" is not a unix service in master.cf'),
    ("bulk_sources = src1 local\n", 'bulk_sources: "local" runs local, not smtp or lmtp'),
    ("bulk_sources =\n", 'bulk_sources: pool "bulk" has no members'),
    ("bulk_sources = src1:0\n", 'bulk_sources: "src1:0": the weight is a number'),
    ("bulk_sources = src1 src1\n", 'bulk_sources: "src1" is listed twice'),
    ("tx_sources = src1\n", 'tx_sources: source "src1" is in pool "bulk" already'),
    ("source_pool_maps = inline:{ bulk=nosuch }\n",
     'source_pool_maps: inline:{ bulk=nosuch }: "bulk" maps to "nosuch", which is not a pool'),
    ("source_pool_transports = smtp nosuch\n",
     'source_pool_transports: master.cf has no unix service "nosuch"'),
    ("source_pool_transports = src1\n",
     'source_pool_transports: "src1" is a source of pool "bulk"'),
    ("src1_source_warmup_start = 20.11.2026\n",
     'src1_source_warmup_start: "20.11.2026" is not a date'),
    ("src1_source_warmup_start = 2026-11-20\n",
     "src1_source_warmup_start: a start date needs a warm-up plan"),
    ("source_warmup_plan = /nonexistent/plan\n",
     "source_warmup_plan: /nonexistent/plan: No such file or directory"),
])
def test_each_mistake_is_a_fatal_line_naming_the_parameter(extra: str, fatal: str) -> None:
    with pytest.raises(PyqmgrCfError) as err:
        settings(GOOD + extra)
    assert str(err.value).startswith("/etc/postfix/pyqmgr.cf: parameter ")
    assert fatal in str(err.value)


def test_a_bad_plan_line_is_fatal_naming_file_and_line(tmp_path: Path) -> None:
    plan = tmp_path / "warmup"
    plan.write_text("0 50\n1 fifty\n")
    with pytest.raises(PyqmgrCfError, match=r"parameter source_warmup_plan: .*warmup, "
                                            r"line 2: '1 fifty': the messages are a number"):
        settings(GOOD + f"source_warmup_plan = {plan}\n")


def test_pool_member_names_are_known_and_others_not() -> None:
    cf = from_text(GOOD + "src1_source_warmup_start = 2026-11-20\nmail_sources = src1\n")
    unknown = [u.name for u in unknown_parameters(cf, list(COMMANDS))]
    assert unknown == ["mail_sources"]


def test_the_shipped_example_plan_parses() -> None:
    from pyqmgr.scheduler.source import parse_plan

    path = Path(__file__).parents[2] / "contrib" / "pyqmgr-warmup"
    plan = parse_plan(path.read_text(), str(path))
    assert plan.allowance(0) and plan.allowance(400) is None
