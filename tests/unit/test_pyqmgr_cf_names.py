"""The registry of pyqmgr.cf's parameters (pyqmgr/pyqmgr_cf_names.py), held to the code
that reads them and to pyqmgr(8) that documents them, and its judgement of names.

A parameter added to the code but not to the registry would be called unknown by
``pyqmgr check`` and warned of by the daemon; one the registry knows but nobody reads
would let a misspelling of nothing pass; one pyqmgr(8) does not document is one an
admin cannot find. Each direction is a test here.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

from pyqmgr.pyqmgr_cf import from_text
from pyqmgr.pyqmgr_cf_names import GLOBAL, KNOWN, PER_TRANSPORT, Names, unknown_parameters
from pyqmgr.scheduler.policy import BUILTIN
from pyqmgr.settings.policies import load

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "pyqmgr")
REGISTRY = os.path.join(PACKAGE, "pyqmgr_cf_names.py")
MAN8 = os.path.join(PACKAGE, "man", "pyqmgr.8")
PARAM_SHAPE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)+")
#: The accessors of PyqmgrCf and of the scheduler's ``setting(name, transport, ...)``.
ACCESSORS = ("get", "get_int", "get_bool", "which", "error")


def test_the_two_sets_do_not_overlap():
    assert not PER_TRANSPORT & GLOBAL
    assert all(PARAM_SHAPE.fullmatch(name) for name in KNOWN)


# -- the registry and the code ---------------------------------------------------------


def _modules() -> dict[str, ast.Module]:
    found = {}
    for dirpath, _, filenames in os.walk(PACKAGE):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if name.endswith(".py") and path != REGISTRY:
                with open(path, encoding="utf-8") as f:
                    found[os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")] = \
                        ast.parse(f.read())
    return found


def _constants(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level ``NAME = "text"`` and ``NAME = (...)`` assignments."""
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant | ast.Tuple)):
            out[node.targets[0].id] = node.value
    return out


def _reads() -> list[tuple[str, bool, str]]:
    """Every parameter name the code reads from pyqmgr.cf, as far as the source says
    it plainly: (name, read per transport, where). Names are literals or module
    constants (imported ones too); reads are PyqmgrCf's accessors on a ``settings`` or
    ``pyqmgr_cf``, the scheduler's ``setting(name, transport, ...)``, a policy's
    ``knob``, a suffix test (``endswith("_" + NAME)``: a transport form), and helpers
    handed ``settings`` and a name (``_duration(settings, TIMEOUT, ...)``)."""
    modules = _modules()
    consts = {name: _constants(tree) for name, tree in modules.items()}
    found = []
    for modname, tree in modules.items():
        known = dict(consts[modname])
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in consts:
                for alias in node.names:
                    if alias.name in consts[node.module]:
                        known[alias.asname or alias.name] = consts[node.module][alias.name]

        def names(node: ast.expr, known: dict[str, ast.expr] = known) -> list[str]:
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                return [node.value]
            if isinstance(node, ast.Name) and node.id in known:
                return names(known[node.id])
            if isinstance(node, ast.Tuple):
                return [n for e in node.elts for n in names(e)]
            if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
                    and names(node.left) == ["_"]):
                return names(node.right)
            return []

        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            where = f"{modname}:{node.lineno}"
            func = node.func
            attr = func.attr if isinstance(func, ast.Attribute) else \
                func.id if isinstance(func, ast.Name) else ""
            receiver = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
            first = node.args[0]
            if attr in ACCESSORS and receiver.endswith(("settings", "pyqmgr_cf")):
                # A transport argument that is a constant is dict.get's default.
                per = (attr != "error" and len(node.args) > 1
                       and not isinstance(node.args[1], ast.Constant))
                found += [(n, per, where) for n in names(first)]
            elif attr in ("setting", "value") and len(node.args) >= 2 or attr in ("knob", "_get"):
                found += [(n, True, where) for n in names(first)]
            elif attr == "endswith" and not isinstance(first, ast.Constant):
                found += [(n, True, where) for n in names(first) if PARAM_SHAPE.fullmatch(n)]
            elif any(isinstance(a, ast.Name) and a.id in ("settings", "pyqmgr_cf")
                     for a in node.args):
                found += [(n, False, where) for a in node.args[1:] for n in names(a)
                          if PARAM_SHAPE.fullmatch(n)]
    return found


def test_every_name_the_code_reads_is_known():
    reads = _reads()
    assert len({name for name, _, _ in reads}) > 50, "the scan found too little to mean much"
    unknown = sorted({(name, where) for name, _, where in reads if name not in KNOWN})
    assert not unknown, f"read by the code, missing from pyqmgr/pyqmgr_cf_names.py: {unknown}"
    global_only = sorted({(name, where) for name, per, where in reads
                          if per and name not in PER_TRANSPORT})
    assert not global_only, f"read per transport, not in PER_TRANSPORT: {global_only}"


def test_every_known_name_is_in_the_code():
    """A name no code mentions is read by nothing: a stale entry would let a
    misspelling of it pass as known."""
    literals: set[str] = set()
    for tree in _modules().values():
        literals |= {n.value for n in ast.walk(tree)
                     if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert sorted(KNOWN - literals) == []


def test_the_built_in_policies_knobs_are_per_transport_names():
    for name in BUILTIN:
        policy = load(name)
        assert set(policy.knobs) <= PER_TRANSPORT, (name, policy.knobs)
        assert set(policy.parameters) <= PER_TRANSPORT, (name, policy.parameters)


# -- the registry and pyqmgr(8) ----------------------------------------------------------


def _parameters_section() -> str:
    with open(MAN8, encoding="utf-8") as f:
        text = f.read()
    start = text.index('.SH "CONFIGURATION PARAMETERS"')
    return text[start:text.index("\n.SH ", start + 1)]


#: Bold words with an underscore in pyqmgr(8)'s parameters that are not pyqmgr.cf's:
#: main.cf parameters, values of pyqmgr.cf's parameters, a response rule's action, a
#: library.
NOT_PYQMGR_CF = {"qmgr_message_active_limit", "proxy_read_maps",  # main.cf
                 "sasl_username", "client_address", "client_name",  # key values
                 "sender_domain", "suspend_tenant", "inotify_simple",
                 "sasl_authenticated",  # a value of sender_keys_trusted_clients
                 "pyqmgr_untrusted_sender_keys_messages_total"}  # a metric


def test_every_known_name_is_documented_in_pyqmgr_8():
    """Each name is in CONFIGURATION PARAMETERS, in bold, and a per-transport one is
    shown as transport_NAME or said to have transport forms; every transport_NAME shown
    is a per-transport name."""
    section = _parameters_section()
    shown = set(re.findall(r"\\fB([a-z][a-z0-9_]*)(?![a-z0-9_])", section))
    per_transport = set(re.findall(r"\\fItransport\\fB_([a-z][a-z0-9_]*)", section))
    missing = sorted(name for name in KNOWN if name not in shown | per_transport)
    assert not missing, f"not documented in pyqmgr(8): {missing}"
    assert per_transport <= PER_TRANSPORT, sorted(per_transport - PER_TRANSPORT)


def test_every_name_pyqmgr_8_documents_is_known():
    section = _parameters_section()
    headings = re.findall(r'^\.IP "(.*)"$', section, re.M)
    in_headings = {m for h in headings
                   for m in re.findall(r"\\f[BI](?:transport\\fB_)?([a-z][a-z0-9_]+)", h)}
    # A whole name: "\fBdelivery_policy_\fR" (the family) is none.
    bold = set(re.findall(r"\\fB([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![a-z0-9_])", section))
    assert in_headings, "no .IP headings found: the page's layout changed?"
    assert sorted((in_headings | bold) - KNOWN - NOT_PYQMGR_CF) == []
    assert not NOT_PYQMGR_CF & KNOWN


# -- judging names -------------------------------------------------------------------------

TRANSPORTS = ("smtp", "relay", "lmtp", "local", "virtual", "retry", "error", "cleanup",
              "bulk_out")


@pytest.mark.parametrize("name, suggestion", [
    ("metrics_lisen", "metrics_listen"),
    ("smtp_destinaton_rate", "smtp_destination_rate"),
    ("site_groupping", "site_grouping"),
    ("scheduler_polcy", "scheduler_policy"),
    ("relay_sheduler_policy", "relay_scheduler_policy"),
    ("shared_state_passwd_file", "shared_state_password_file"),
    ("bulk_out_tenant_rat", "bulk_out_tenant_rate"),
])
def test_a_misspelling_is_named_with_the_nearest_known_name(name, suggestion):
    found = Names(TRANSPORTS).check(name)
    assert found is not None and found.suggestion == suggestion
    assert found.text("/etc/postfix/pyqmgr.cf") == (
        f"/etc/postfix/pyqmgr.cf: unknown parameter {name} (did you mean {suggestion}?)")


@pytest.mark.parametrize("name", [
    "scheduler_policy", "smtp_scheduler_policy", "relay_destination_rate",
    "bulk_out_tenant_site_rate", "local_delivery_policy_service",
    "smtp_finch_scale_max_concurrency", "lmtp_fleet_site_rate_burst",
    "smtp_tenant_site_concurrency_limit", "metrics_listen", "site_concurrency_limit_maps",
])
def test_known_names_and_transport_forms_pass(name):
    assert Names(TRANSPORTS).check(name) is None


def test_a_global_parameter_has_no_transport_form():
    found = Names(TRANSPORTS).check("smtp_metrics_listen")
    assert found is not None and found.why == "metrics_listen has no per-transport form"


def test_a_transport_master_cf_does_not_have():
    """postconf knows <service>_<name> only for master.cf's services: a form for any
    other prefix applies to nothing, and the nearest transport is offered."""
    names = Names(TRANSPORTS)
    found = names.check("smpt_destination_rate")
    assert found is not None and found.suggestion == "smtp_destination_rate"
    assert found.why == "master.cf has no smpt service: it applies to nothing"
    assert names.check("newsletters_destination_rate") == type(found)(
        "newsletters_destination_rate", None,
        "master.cf has no newsletters service: it applies to nothing")
    # master.cf not known: never guessed at.
    assert Names(None).check("newsletters_destination_rate") is None
    assert Names(None).check("smtp_destinaton_rate") is not None


def test_the_admins_own_names_and_a_module_policys_are_known(tmp_path):
    """A name another value uses as $name is the admin's own (postconf does not warn of
    it either); a module: policy's knobs and parameters are known while it is in use."""
    cf = from_text("my_rate = 10/1s\nsmtp_destination_rate = ${my_rate}\n"
                   "unused_note = x\nsmtp_mine_limit = 3\nmine_path = /x\n", "pyqmgr.cf")
    assert [u.name for u in unknown_parameters(cf, TRANSPORTS)] == [
        "unused_note", "smtp_mine_limit", "mine_path"]

    class Mine:
        knobs = {"mine_limit": ("5", "int", 1, 10)}
        parameters = ("mine_path",)

    assert [u.name for u in unknown_parameters(cf, TRANSPORTS, [Mine])] == ["unused_note"]


def test_contribs_policy_declares_what_it_reads():
    """contrib/sender_classes.py: its knobs, in use, are not unknown."""
    path = os.path.join(ROOT, "contrib", "sender_classes.py")
    policy = load(f"module:{path}")
    cf = from_text("".join(f"smtp_{knob} = 1\n" for knob in policy.knobs), "pyqmgr.cf")
    assert policy.knobs and unknown_parameters(cf, TRANSPORTS, [policy]) == []
    assert len(unknown_parameters(cf, TRANSPORTS)) == len(policy.knobs)


def test_check_names_unknown_names_even_when_it_cannot_judge_the_values(tmp_path):
    """An installation the trust check refuses is not imported from (no policy loads),
    yet its misspellings are named, against master.cf's transports; with a module:
    policy, whose own names are unknown until it loads, nothing is said."""
    from pyqmgr.settings_check import SettingsFindings, unknown_names_only

    (tmp_path / "master.cf").write_text("smtp unix - - n - 10 smtp\n")
    cf = from_text("metrics_lisen = 9155\nbulk_destination_rate = 1/1s\n", "pyqmgr.cf")
    found = SettingsFindings()
    assert unknown_names_only(cf, str(tmp_path), found) == [
        "pyqmgr.cf: unknown parameter metrics_lisen (did you mean metrics_listen?)",
        "pyqmgr.cf: unknown parameter bulk_destination_rate (master.cf has no bulk "
        "service: it applies to nothing)"]
    assert [u.name for u in found.unknown] == ["metrics_lisen", "bulk_destination_rate"]
    policy = from_text("scheduler_policy = module:/etc/postfix/mine.py\nmine_knob = 1\n",
                       "pyqmgr.cf")
    assert unknown_names_only(policy, str(tmp_path), SettingsFindings()) == []
