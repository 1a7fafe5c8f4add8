"""pyqmgr.cf: main.cf syntax through main.cf's own reader, pyqmgr's own semantics.

These need neither Postfix nor root (one test drops to nobody when run as root, to
make "permission denied" real).
"""

from __future__ import annotations

import os
import pwd
import tempfile

import pytest

from pyqmgr.postfix.config import ConfigError, parse_main_cf
from pyqmgr.pyqmgr_cf import MAX_SIZE, PyqmgrCf, PyqmgrCfError, from_text, load

PATH = "/etc/postfix/pyqmgr.cf"


def main_cf(values: dict[str, str]):
    return values.get


def test_comments_blank_lines_and_continuation_lines():
    cf = from_text(
        "# a comment\n"
        "\n"
        "scheduler_policy = fifo\n"
        "long_list = a,\n"
        "    b,\n"
        "# a comment inside a continued value does not end it\n"
        "\tc\n"
        "last = 1\n", PATH)
    assert cf.exists and cf.path == PATH
    assert cf.names() == ["scheduler_policy", "long_list", "last"]
    # Glued on as main.cf does: the continuation keeps its leading whitespace.
    assert cf.get("long_list") == "a,    b,\tc"
    assert cf.get("last") == "1"
    assert cf.warnings == ()


def test_dollar_expansion_own_names_first_then_main_cf():
    cf = from_text(
        "base = /var/lib/pyqmgr\n"
        "policy_dir = $base/policies\n"
        "braced = ${base}x\n"
        "from_main = $myhostname:${queue_directory}\n"
        "shadowed = $mail_owner\n"
        "mail_owner = mine\n"
        "undefined = [$nowhere]\n"
        "dollar = $$5\n",
        PATH, main_cf({"myhostname": "mx.example", "queue_directory": "/q",
                       "mail_owner": "postfix"}))
    assert cf.get("policy_dir") == "/var/lib/pyqmgr/policies"
    assert cf.get("braced") == "/var/lib/pyqmgrx"
    assert cf.get("from_main") == "mx.example:/q"
    assert cf.get("shadowed") == "mine", "pyqmgr.cf's own names win over main.cf's"
    assert cf.get("undefined") == "[]", "an unknown name expands to nothing, as in Postfix"
    assert cf.get("dollar") == "$5"


def test_main_cf_values_are_expanded_recursively():
    cf = from_text("x = $relay\n", PATH, main_cf({"relay": "[$myhostname]:25",
                                                  "myhostname": "h"}))
    assert cf.get("x") == "[h]:25"


def test_conditional_expansion_uses_postfix_rules():
    cf = from_text("a = ${debug?{on}:{off}}\nb = ${nothing?{on}:{off}}\ndebug = yes\n", PATH)
    assert (cf.get("a"), cf.get("b")) == ("on", "off")


def test_transport_specific_name_wins_and_which_says_which():
    cf = from_text("scheduler_policy = nqmgr\nsmtp_scheduler_policy = fifo\nempty =\n", PATH)
    assert cf.get("scheduler_policy", "smtp") == "fifo"
    assert cf.which("scheduler_policy", "smtp") == "smtp_scheduler_policy"
    assert cf.get("scheduler_policy", "relay") == "nqmgr"
    assert cf.which("scheduler_policy", "relay") == "scheduler_policy"
    assert cf.get("scheduler_policy") == "nqmgr"
    assert cf.get("other", "smtp") is None and cf.which("other", "smtp") is None
    assert cf.get("empty") == "", "set to nothing is still set"


def test_get_int_and_its_errors_name_the_file_and_the_parameter_used():
    cf = from_text("limit = 10\nsmtp_limit = ten\nlmtp_limit = 500\nplus = +7\n"
                   "huge = 99999999999999999999\n", PATH)
    assert cf.get_int("limit", None, 3) == 10
    assert cf.get_int("limit", "relay", 3, 1, 100) == 10
    assert cf.get_int("unset", "smtp", 3) == 3
    assert cf.get_int("plus", None, 0) == 7
    with pytest.raises(PyqmgrCfError) as err:
        cf.get_int("limit", "smtp", 3)
    assert str(err.value) == f'{PATH}: parameter smtp_limit: bad numerical value: "ten"'
    with pytest.raises(PyqmgrCfError) as err:
        cf.get_int("limit", "lmtp", 3, 1, 100)
    assert str(err.value) == f"{PATH}: parameter lmtp_limit: value 500 is out of range 1..100"
    with pytest.raises(PyqmgrCfError, match="parameter limit: value 10 is out of range 11"):
        cf.get_int("limit", None, 3, lo=11)
    with pytest.raises(PyqmgrCfError, match="parameter huge: "):
        cf.get_int("huge", None, 0)


@pytest.mark.parametrize("text", ["5k", "", " ", "0x10", "1.5"])
def test_get_int_refuses_what_postfix_refuses(text):
    with pytest.raises(PyqmgrCfError, match="bad numerical value"):
        from_text(f"n = {text}\n", PATH).get_int("n", None, 0)


def test_get_bool_accepts_yes_and_no_in_any_case():
    cf = from_text("a = YES\nb = no\nsmtp_b = Yes\nc = maybe\n", PATH)
    assert cf.get_bool("a", None, False) is True
    assert cf.get_bool("b", None, True) is False
    assert cf.get_bool("b", "smtp", False) is True
    assert cf.get_bool("unset", None, True) is True
    with pytest.raises(PyqmgrCfError) as err:
        cf.get_bool("c", "smtp", False)
    assert str(err.value) == f'{PATH}: parameter c: bad boolean value: "maybe" (use yes or no)'


def test_error_helper_gives_callers_the_same_format():
    cf = from_text("smtp_scheduler_policy = foo\n", PATH)
    used = cf.which("scheduler_policy", "smtp")
    assert used is not None
    err = cf.error(used, 'unknown scheduler policy "foo"')
    assert isinstance(err, PyqmgrCfError)
    assert str(err) == (f'{PATH}: parameter smtp_scheduler_policy: '
                        'unknown scheduler policy "foo"')


def test_line_without_equals_is_fatal_exactly_as_in_main_cf():
    text = "a = 1\n# c\nbogus line\n  continued\n"
    with pytest.raises(ConfigError) as main:
        parse_main_cf(text, PATH)
    with pytest.raises(PyqmgrCfError) as ours:
        from_text(text, PATH)
    assert str(ours.value) == str(main.value) == (
        f"{PATH}, line 3: missing '=' after attribute name: \"bogus line  continued\"")


def test_duplicates_and_orphan_continuations_warn_as_in_main_cf():
    cf = from_text("  orphan = 1\na = 1\na = 1\na = 2\n", PATH)
    assert cf.get("a") == "2"
    assert cf.warnings == (
        f'{PATH}: logical line must not start with whitespace: "  orphan = 1"',
        f"{PATH}, line 4: overriding earlier entry: a=1",
    )


def test_bad_expansion_is_an_error_naming_the_parameter():
    with pytest.raises(PyqmgrCfError) as err:
        from_text("good = 1\nbroken = ${unclosed\n", PATH)
    assert str(err.value).startswith(f"{PATH}: parameter broken: bad $name expansion: ")
    assert "truncated macro reference" in str(err.value)
    with pytest.raises(PyqmgrCfError, match="parameter loop: bad [$]name expansion: "
                                            "unreasonable macro call nesting"):
        from_text("loop = $loop\n", PATH)


def test_module_paths_are_found_and_relative_ones_reported():
    cf = from_text("scheduler_policy = module:/etc/postfix/p.py\n"
                   "smtp_scheduler_policy = module:policies/fair.py\n"
                   "other = fifo\n", PATH)
    assert cf.module_paths() == {"scheduler_policy": "/etc/postfix/p.py",
                                 "smtp_scheduler_policy": "policies/fair.py"}
    assert cf.relative_module_paths() == [
        f'{PATH}: parameter smtp_scheduler_policy: module path "policies/fair.py" '
        "is not absolute"]


def test_missing_file_means_no_settings(tmp_path):
    cf = load(str(tmp_path))
    assert cf == PyqmgrCf(path=str(tmp_path / "pyqmgr.cf"), exists=False)
    assert cf.names() == [] and cf.get("anything", "smtp") is None
    assert cf.get_int("n", "smtp", 7) == 7 and cf.get_bool("b", None, True) is True
    assert cf.module_paths() == {}


def test_load_reads_the_file_and_uses_the_main_lookup(tmp_path):
    (tmp_path / "pyqmgr.cf").write_text("where = $queue_directory/x\n")
    cf = load(str(tmp_path), main_cf({"queue_directory": "/q"}))
    assert cf.exists and cf.get("where") == "/q/x"


def test_a_directory_in_place_of_the_file_is_a_clear_error(tmp_path):
    (tmp_path / "pyqmgr.cf").mkdir()
    with pytest.raises(PyqmgrCfError) as err:
        load(str(tmp_path))
    assert str(err.value) == f"{tmp_path}/pyqmgr.cf: is a directory, not a settings file"


def test_a_fifo_is_refused_without_hanging(tmp_path):
    os.mkfifo(tmp_path / "pyqmgr.cf")
    with pytest.raises(PyqmgrCfError, match="pyqmgr.cf: not a regular file"):
        load(str(tmp_path))


def test_a_dangling_symlink_is_an_error_not_silence(tmp_path):
    os.symlink(tmp_path / "gone", tmp_path / "pyqmgr.cf")
    with pytest.raises(PyqmgrCfError, match=r"open .*pyqmgr.cf: No such file or directory "
                                            r"\(dangling symbolic link\)"):
        load(str(tmp_path))


def test_an_oversized_file_is_refused_unread(tmp_path, monkeypatch):
    path = tmp_path / "pyqmgr.cf"
    with open(path, "wb") as f:
        f.truncate(MAX_SIZE + 1)  # sparse: costs no disk
    reads: list[int] = []
    real_fdopen = os.fdopen

    def spy_fdopen(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        real_read = f.read
        f.read = lambda *a: reads.append(1) or real_read(*a)  # type: ignore[method-assign]
        return f

    monkeypatch.setattr(os, "fdopen", spy_fdopen)
    with pytest.raises(PyqmgrCfError) as err:
        load(str(tmp_path))
    assert str(err.value) == (f"{path}: file too large ({MAX_SIZE + 1} bytes; "
                              f"the limit is {MAX_SIZE})")
    assert reads == [], "the size is judged before anything is read"
    monkeypatch.undo()
    head = b"a = 1\n"
    path.write_bytes(head + b"#" * (MAX_SIZE - len(head) - 1) + b"\n")
    assert load(str(tmp_path)).get("a") == "1", "exactly the limit is accepted"


def test_an_unreadable_file_is_a_clear_error(pyqmgr_for_others):
    """Permission denied for real: as root the read happens in a child run as nobody
    (from a copy of pyqmgr nobody can read: the suite's venv may be under /root)."""
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        path = os.path.join(d, "pyqmgr.cf")
        with open(path, "w") as f:
            f.write("a = 1\n")
        os.chmod(path, 0o600 if os.geteuid() == 0 else 0o000)
        code = ("import sys\nfrom pyqmgr.pyqmgr_cf import PyqmgrCfError, load\n"
                "try:\n    load(sys.argv[1])\nexcept PyqmgrCfError as e:\n    print(e)\n")
        others = pyqmgr_for_others
        nobody = pwd.getpwuid(65534) if os.geteuid() == 0 else None
        proc = others.run(others.python("-c", code, d), nobody, timeout=60)
        assert proc.stdout.strip() == f"open {path}: Permission denied", proc.stderr
