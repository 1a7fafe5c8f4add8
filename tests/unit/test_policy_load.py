"""scheduler_policy's loader and the start-up policy table: every error says why.

``load`` turns a ``scheduler_policy`` value into a class (a built-in name or
``module:PATH``); ``policy_table`` does that for every ``[<transport>_]
scheduler_policy`` in pyqmgr.cf and checks the knobs of the policies in use. Their
texts end up after ``fatal: <pyqmgr.cf>: parameter <name>: `` in the maillog, so they
are pinned here word for word. No Postfix needed.
"""

from __future__ import annotations

import os

import pytest

from pyqmgr.pyqmgr_cf import PyqmgrCf, PyqmgrCfError, from_text
from pyqmgr.scheduler.finch import Finch
from pyqmgr.scheduler.nqmgr import Nqmgr
from pyqmgr.scheduler.oqmgr import Oqmgr
from pyqmgr.scheduler.policy import BUILTIN, Policy, PolicyTable, parse_knob
from pyqmgr.scheduler.zmailer import Zmailer
from pyqmgr.settings.policies import PolicyError, load, policy_table

CF = "/etc/postfix/pyqmgr.cf"

ONE_POLICY = """\
from pyqmgr.scheduler.entry import entry_select
from pyqmgr.scheduler.policy import Policy


class Mine(Policy):
    def select(self):
        return None
"""


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def build(text: str) -> PolicyTable:
    """What the daemon does at start-up (pyqmgr.daemon.policies), minus master.cf."""
    cf: PyqmgrCf = from_text(text, CF)
    values = {name: cf.get(name) or "" for name in cf.names()}

    def setting(name: str, transport: str, default: str) -> str:
        value = cf.get(name, transport)
        return default if value is None else value

    return policy_table(values, setting, cf.error)


def build_error(text: str) -> str:
    with pytest.raises(PyqmgrCfError) as info:
        build(text)
    return str(info.value)


# -- load ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,cls", [("nqmgr", Nqmgr), ("oqmgr", Oqmgr), ("finch", Finch),
                                      ("zmailer", Zmailer), (" finch ", Finch)])
def test_builtin_names(name, cls):
    assert load(name) is cls
    assert cls.name == name.strip()


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(PolicyError) as info:
        load("nosuch")
    assert str(info.value) == ('unknown scheduler policy "nosuch" (known: nqmgr, oqmgr, '
                               'finch, zmailer, or module:PATH)')
    assert list(BUILTIN) == ["nqmgr", "oqmgr", "finch", "zmailer"]


@pytest.mark.parametrize("spec", ["NQMGR", "module", "Module:/x.py", ""])
def test_names_are_exact(spec):
    with pytest.raises(PolicyError, match="unknown scheduler policy"):
        load(spec)


def test_relative_path_is_refused_not_guessed():
    with pytest.raises(PolicyError) as info:
        load("module:policies/mine.py")
    assert str(info.value) == 'policy module "policies/mine.py": the path must be absolute'


def test_missing_file(tmp_path):
    path = str(tmp_path / "missing.py")
    with pytest.raises(PolicyError) as info:
        load(f"module:{path}")
    assert str(info.value) == f'policy module "{path}": no such file'


def test_not_a_python_file(tmp_path):
    path = write(tmp_path, "policy.txt", ONE_POLICY)
    with pytest.raises(PolicyError) as info:
        load(f"module:{path}")
    assert str(info.value) == f'policy module "{path}": not a Python file'


def test_syntax_error_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "broken.py", "class Broken(Policy)\n    pass\n")
    with pytest.raises(PolicyError) as info:
        load(f"module:{path}")
    text = str(info.value)
    assert text.startswith(f'policy module "{path}" does not load: SyntaxError: ')
    assert "line 1" in text


def test_an_error_while_importing_is_a_load_failure(tmp_path):
    path = write(tmp_path, "raises.py", "raise RuntimeError('not today')\n")
    with pytest.raises(PolicyError) as info:
        load(f"module:{path}")
    assert str(info.value) == (f'policy module "{path}" does not load: '
                               "RuntimeError: not today")
    path = write(tmp_path, "imports.py", "import pyqmgr_no_such_module\n")
    with pytest.raises(PolicyError, match="does not load: ModuleNotFoundError: "):
        load(f"module:{path}")


def test_a_module_without_a_policy_subclass(tmp_path):
    path = write(tmp_path, "none.py", "from pyqmgr.scheduler.policy import Policy\n"
                                      "class NotAPolicy:\n    pass\n")
    with pytest.raises(PolicyError) as info:
        load(f"module:{path}")
    assert str(info.value) == f'policy module "{path}" must define one Policy subclass, found 0'


def test_a_module_with_two_policy_subclasses(tmp_path):
    path = write(tmp_path, "two.py", ONE_POLICY + "\n\nclass Other(Mine):\n    pass\n")
    with pytest.raises(PolicyError) as info:
        load(f"module:{path}")
    assert str(info.value) == f'policy module "{path}" must define one Policy subclass, found 2'


def test_imported_policies_do_not_count_and_the_name_defaults_to_the_file(tmp_path):
    """Subclasses imported from elsewhere (a built-in to extend) are not candidates."""
    path = write(tmp_path, "mine.py",
                 "from pyqmgr.scheduler.oqmgr import Oqmgr\n\n"
                 "class Mine(Oqmgr):\n    name = ''\n")
    cls = load(f"module:{path}")
    assert cls.__name__ == "Mine" and issubclass(cls, Oqmgr)
    assert cls.name == "module:mine.py"
    named = write(tmp_path, "named.py", ONE_POLICY.replace("class Mine(Policy):\n",
                                                           "class Mine(Policy):\n"
                                                           "    name = 'mine'\n"))
    assert load(f"module:{named}").name == "mine"


def test_the_contrib_example_loads():
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "contrib", "sender_classes.py")
    cls = load(f"module:{os.path.abspath(path)}")
    assert issubclass(cls, Policy) and cls.name == "sender_classes"
    assert set(cls.knobs) == {"sender_classes_small_limit", "sender_classes_medium_limit",
                              "sender_classes_small_weight", "sender_classes_medium_weight",
                              "sender_classes_large_weight"}


# -- policy_table: which parameter is to blame --------------------------------------------


def test_no_settings_is_stock():
    table = build("")
    assert table.default is Nqmgr and table.stock and not table.bounded_reading


def test_default_and_transport_forms():
    table = build("scheduler_policy = oqmgr\nsmtp_scheduler_policy = finch\n")
    assert table.policy_for("smtp") is Finch
    assert table.policy_for("local") is Oqmgr
    assert table.bounded_reading and not table.stock


def test_unknown_name_names_the_file_and_parameter():
    assert build_error("scheduler_policy = nosuch\n") == (
        f'{CF}: parameter scheduler_policy: unknown scheduler policy "nosuch" (known: '
        "nqmgr, oqmgr, finch, zmailer, or module:PATH)")


def test_transport_form_is_the_parameter_named(tmp_path):
    assert build_error("scheduler_policy = nqmgr\nsmtp_scheduler_policy = fifo\n") == (
        f'{CF}: parameter smtp_scheduler_policy: unknown scheduler policy "fifo" (known: '
        "nqmgr, oqmgr, finch, zmailer, or module:PATH)")
    missing = str(tmp_path / "nonexistent.py")
    assert build_error(f"smtp_scheduler_policy = module:{missing}\n") == (
        f'{CF}: parameter smtp_scheduler_policy: policy module "{missing}": no such file')
    assert build_error("relay_scheduler_policy = module:mine.py\n") == (
        f'{CF}: parameter relay_scheduler_policy: policy module "mine.py": the path must '
        "be absolute")


def test_values_are_expanded_before_loading(tmp_path):
    write(tmp_path, "mine.py", ONE_POLICY)
    table = build(f"policy_dir = {tmp_path}\nscheduler_policy = module:$policy_dir/mine.py\n")
    assert table.default.__name__ == "Mine"
    assert table.default.name == "module:mine.py"


def test_a_syntax_error_names_the_parameter(tmp_path):
    path = write(tmp_path, "broken.py", "def (\n")
    text = build_error(f"scheduler_policy = module:{path}\n")
    assert text.startswith(f'{CF}: parameter scheduler_policy: policy module "{path}" '
                           "does not load: SyntaxError: ")


# -- knobs ----------------------------------------------------------------------------


def test_bad_integer_knob():
    assert build_error("scheduler_policy = finch\nfinch_max_message_concurrency = ten\n") == (
        f'{CF}: parameter finch_max_message_concurrency: bad numerical configuration: '
        '"ten" is not an integer')


def test_transport_specific_knob_is_named_as_written():
    assert build_error("scheduler_policy = finch\n"
                       "smtp_finch_scale_max_concurrency = lots\n") == (
        f'{CF}: parameter smtp_finch_scale_max_concurrency: bad numerical configuration: '
        '"lots" is not a number')
    assert build_error("smtp_scheduler_policy = finch\n"
                       "smtp_finch_max_message_concurrency = 2.5\n") == (
        f'{CF}: parameter smtp_finch_max_message_concurrency: bad numerical '
        'configuration: "2.5" is not an integer')


def test_knob_below_its_minimum():
    assert build_error("scheduler_policy = finch\nfinch_max_message_concurrency = -1\n") == (
        f"{CF}: parameter finch_max_message_concurrency: value -1 must be at least 0")
    assert build_error("scheduler_policy = finch\n"
                       "relay_finch_scale_max_concurrency = -0.5\n") == (
        f"{CF}: parameter relay_finch_scale_max_concurrency: value -0.5 must be at least 0")


def test_good_knobs_pass_and_reach_the_policy():
    table = build("scheduler_policy = finch\nfinch_max_message_concurrency = 3\n"
                  "smtp_finch_scale_max_concurrency = 2.5\n")
    assert table.setting is not None
    assert table.setting("finch_scale_max_concurrency", "smtp", "10") == "2.5"
    assert table.setting("finch_scale_max_concurrency", "relay", "10") == "10"
    assert table.setting("finch_max_message_concurrency", "relay", "10") == "3"


def test_bad_boolean_knob():
    assert build_error("scheduler_policy = zmailer\nzmailer_ageorder = maybe\n") == (
        f'{CF}: parameter zmailer_ageorder: bad boolean configuration: "maybe" (yes or no)')
    assert build_error("smtp_scheduler_policy = zmailer\nsmtp_zmailer_ageorder = 1\n") == (
        f'{CF}: parameter smtp_zmailer_ageorder: bad boolean configuration: "1" (yes or no)')
    build("scheduler_policy = zmailer\nzmailer_ageorder = NO\nsmtp_zmailer_ageorder = Yes\n")


def test_knobs_of_policies_not_in_use_are_not_checked():
    """A leftover knob of a policy no transport runs is not an error (nor read)."""
    build("scheduler_policy = oqmgr\nfinch_max_message_concurrency = ten\n")


def test_a_module_policys_knobs_are_checked_too(tmp_path):
    path = write(tmp_path, "knobbed.py", ONE_POLICY.replace(
        "class Mine(Policy):\n",
        "class Mine(Policy):\n    knobs = {'mine_limit': ('5', 'int', 1, 10),\n"
        "             'mine_fast': ('no', 'bool', 0, None)}\n"))
    head = f"scheduler_policy = module:{path}\n"
    assert build_error(head + "mine_limit = 11\n") == (
        f"{CF}: parameter mine_limit: value 11 must be at least 1 and at most 10")
    assert build_error(head + "smtp_mine_limit = 0\n") == (
        f"{CF}: parameter smtp_mine_limit: value 0 must be at least 1 and at most 10")
    assert build_error(head + "smtp_mine_fast = on\n") == (
        f'{CF}: parameter smtp_mine_fast: bad boolean configuration: "on" (yes or no)')
    build(head + "mine_limit = 10\nsmtp_mine_fast = yes\n")


@pytest.mark.parametrize("value,kind,want", [("7", "int", 7), (" 7 ", "int", 7),
                                             ("0.25", "number", 0.25), ("1e2", "number", 100),
                                             ("yes", "bool", 1), ("No", "bool", 0)])
def test_parse_knob_values(value, kind, want):
    assert parse_knob(value, kind, 0) == want


@pytest.mark.parametrize("value,kind,text", [
    ("", "int", 'bad numerical configuration: "" is not an integer'),
    ("5k", "int", 'bad numerical configuration: "5k" is not an integer'),
    ("x", "number", 'bad numerical configuration: "x" is not a number'),
    ("true", "bool", 'bad boolean configuration: "true" (yes or no)'),
])
def test_parse_knob_errors(value, kind, text):
    with pytest.raises(ValueError) as info:
        parse_knob(value, kind, 0)
    assert str(info.value) == text


def test_a_policy_module_runs_from_its_source_never_from_a_pycache(tmp_path):
    """A .pyc in __pycache__ whose header (the source's mtime and size) matches is what
    Python's own loader runs instead of the source; the trust check judges the source,
    so the loader must not (issue #31)."""
    import py_compile

    real = ONE_POLICY.replace("class Mine(Policy):", "class Real(Policy):")
    swapped = ONE_POLICY.replace("class Mine(Policy):", "class Evil(Policy):")
    assert len(real) == len(swapped)
    path = write(tmp_path, "mine.py", swapped)
    py_compile.compile(path, doraise=True)  # __pycache__/mine.cpython-*.pyc: Evil
    st = os.stat(path)
    with open(path, "w") as f:
        f.write(real)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.listdir(tmp_path / "__pycache__"), "a matching .pyc is there"
    assert load(f"module:{path}").__name__ == "Real"
    assert not any(name.startswith("pyqmgr_policy_") and "Evil" in vars(m)
                   for name, m in __import__("sys").modules.items())
