"""qmgr's configuration view, checked against the real Postfix 3.7.11.

Two oracles, each where it is right:
- ``postconf -x`` for main.cf parsing and ``$`` expansion of names that main.cf
  defines (postconf and a daemon agree there);
- the real qmgr binary run by hand (``qmgr -S -d -V -v -v``) for everything that
  depends on being a daemon: which names are registered when, the defaults written
  into the dictionary (its ``dict_update:`` trace), fatal texts and warnings.
A fatal qmgr sleeps a second before exiting, so all stock runs of a group are
started at once and awaited together.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyqmgr.postfix.config import (
    STARTUP_PARAMETERS,
    ConfigError,
    QmgrConfig,
    conv_time,
    logical_lines,
    option_nameval,
    parse_main_cf,
    split_list,
)
from pyqmgr.postfix.expand import (
    ConversionFatal,
    MacroError,
    compat_level_from_string,
    expand,
)

STOCK_QMGR = "/usr/lib/postfix/sbin/qmgr"
HAVE_POSTCONF = shutil.which("postconf") is not None
HAVE_QMGR = os.access(STOCK_QMGR, os.X_OK) and os.geteuid() == 0

needs_postconf = pytest.mark.skipif(not HAVE_POSTCONF, reason="postconf not installed")
needs_qmgr = pytest.mark.skipif(not HAVE_QMGR, reason="stock qmgr not runnable as root")


# -- oracles -------------------------------------------------------------------------------


def _write_main_cf(directory: Path, text: str, master_cf: str = "") -> None:
    path = directory / "main.cf"
    path.write_text(text)
    (directory / "master.cf").write_text(master_cf)
    # Postfix re-reads a main.cf younger than a second every 300 ms: backdate it.
    past = time.time() - 3600
    os.utime(path, (past, past))


def run_until_fatal(command: list[str], stdin: bytes = b"",
                    env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a Postfix program, killing it once it has logged ``fatal:``.

    msg_fatal() sleeps a second before exiting; waiting for that would make every
    error case cost a second.
    """
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out,
                                stderr=subprocess.PIPE, env=env)
        assert proc.stdin is not None and proc.stderr is not None
        proc.stdin.write(stdin)
        proc.stdin.close()
        lines = []
        for raw in proc.stderr:
            line = raw.decode("utf-8", "surrogateescape")
            lines.append(line)
            if ": fatal: " in line:
                proc.kill()
                break
        proc.stderr.close()
        returncode = proc.wait()
        returncode = 1 if returncode < 0 else returncode
        out.seek(0)
        stdout = out.read().decode("utf-8", "surrogateescape")
    return subprocess.CompletedProcess(command, returncode, stdout, "".join(lines))


def postconf(directory: Path, main_cf: str, *args: str,
             master_cf: str = "") -> subprocess.CompletedProcess[str]:
    _write_main_cf(directory, main_cf, master_cf)
    return run_until_fatal(["postconf", "-c", str(directory), *args])


def squeeze(value: str) -> str:
    """postconf prints runs of whitespace as one space and trims the ends."""
    return " ".join(value.split())


@dataclass
class StockRun:
    """What stock qmgr did with one configuration."""

    config_dir: str
    returncode: int
    updates: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    fatal: str | None = None


def _run_stock(main_cf: str, args: tuple[str, ...], argv0: str | None) -> StockRun:
    directory = tempfile.mkdtemp(prefix="stockqmgr")
    queue = os.path.join(directory, "queue")
    for sub in ("incoming", "active", "deferred", "corrupt", "defer", "bounce"):
        os.makedirs(os.path.join(queue, sub))
    _write_main_cf(Path(directory), main_cf.replace("@QUEUE@", queue))
    command = [argv0 or STOCK_QMGR, "-S", "-d", "-V", "-v", "-v", "-l", "-t", "unix", *args]
    # One trigger byte on stdin: stand-alone mode handles it and exits at once.
    proc = run_until_fatal(command, b"W", {"MAIL_CONFIG": directory, "PATH": "/usr/bin:/bin"})
    run = StockRun(directory, proc.returncode)
    for line in proc.stderr.splitlines():
        _tag, _, text = line.partition(": ")
        if text.startswith("dict_update: "):
            name, _, value = text[len("dict_update: "):].partition(" = ")
            run.updates.append((name, value))
        elif text.startswith("warning: "):
            run.warnings.append(text[len("warning: "):])
        elif text.startswith("fatal: "):
            run.fatal = text[len("fatal: "):]
    shutil.rmtree(directory, ignore_errors=True)
    return run


def run_stock_many(cases: list[tuple[str, tuple[str, ...], str | None]]) -> list[StockRun]:
    """Run stock qmgr on each (main.cf, extra argv, argv[0]) at the same time."""
    with ThreadPoolExecutor(max_workers=max(1, len(cases))) as pool:
        return list(pool.map(lambda case: _run_stock(*case), cases))


def mine(main_cf: str, config_dir: str, overrides: list[tuple[str, str]],
         process_name: str = "qmgr") -> QmgrConfig | ConfigError:
    try:
        return QmgrConfig.from_text(main_cf, overrides, config_dir=config_dir,
                                    process_name=process_name)
    except ConfigError as exc:
        return exc


def overrides_of(args: tuple[str, ...]) -> list[tuple[str, str]]:
    return [option_nameval(args[i + 1]) for i, word in enumerate(args) if word == "-o"]


# -- main.cf reading -----------------------------------------------------------------------


def test_continuation_keeps_indentation_and_skips_comments_and_blank_lines():
    text = "a = one\n\n# comment\n    two,\n   # indented comment\n\tthree\nb=x\n"
    values, warnings = parse_main_cf(text, "/c/main.cf")
    assert values == {"a": "one    two,\tthree", "b": "x"}
    assert warnings == []


def test_hash_after_text_and_no_backslash_continuation():
    values, _ = parse_main_cf("x = 4 # not a comment\ny = a\\\nz = 1\n")
    assert values == {"x": "4 # not a comment", "y": "a\\", "z": "1"}


def test_name_may_contain_dashes_and_spaces_around_equals_are_trimmed():
    values, _ = parse_main_cf("scalemail-backend_destination_concurrency_limit   =   3  \r\n")
    assert values == {"scalemail-backend_destination_concurrency_limit": "3"}


def test_line_without_equals_is_fatal_with_first_line_number():
    with pytest.raises(ConfigError) as err:
        parse_main_cf("a = 1\n# c\nbogus line\n  continued\n", "/c/main.cf")
    assert str(err.value) == ("/c/main.cf, line 3: missing '=' after attribute name: "
                              "\"bogus line  continued\"")
    with pytest.raises(ConfigError, match=r"line 1: missing attribute name: \"= 5\""):
        parse_main_cf("= 5\n", "/c/main.cf")


def test_duplicates_last_wins_and_warn_only_when_the_value_changes():
    values, warnings = parse_main_cf("a = 1\nb = 2\na = 1\na = 3\n", "/c/main.cf")
    assert values["a"] == "3"
    assert warnings == ["/c/main.cf, line 4: overriding earlier entry: a=1"]


def test_leading_whitespace_without_preceding_text_is_discarded_with_a_warning():
    warnings: list[str] = []
    lines = logical_lines("# c\n   orphan = 1\n  more\nx = 2\n", "/c/main.cf", warnings)
    assert lines == [(4, "x = 2")]
    assert warnings == ['/c/main.cf: logical line must not start with whitespace: '
                        '"   orphan = 1  more"']


@needs_postconf
def test_a_daemon_warns_when_main_cf_changes_config_directory(tmp_path):
    # config_directory is in the dictionary before main.cf is read; postconf agrees.
    main_cf = "config_directory = /elsewhere\n"
    proc = postconf(tmp_path, main_cf, "-h", "config_directory")
    cfg = QmgrConfig.from_text(main_cf, config_dir=str(tmp_path), hostname="h")
    assert cfg.warnings == [f"{tmp_path}/main.cf, line 1: overriding earlier entry: "
                            f"config_directory={tmp_path}"]
    assert f"postconf: warning: {cfg.warnings[0]}" in proc.stderr.splitlines()
    assert cfg.get("config_directory") == proc.stdout.strip() == "/elsewhere"


TRICKY_MAIN_CF = """\
# a comment
smtpd_banner = $myhostname   ESMTP\t$mail_name
myhostname = mx.example.com
mydomain = example.com
delay_notice_recipient = one,

# comment inside a continued value
    two,
\tthree # four
bounce_notice_recipient = ${mydomain?{has $mydomain}:{none}} ${nothing:empty} ${nothing?x}
error_notice_recipient = $(mydomain)-${mydomain}-$$-$$mydomain
2bounce_notice_recipient = ${{$mydomain} == {example.com} ? {same} : {different}}
header_checks = ${{10} < {9}}|${{abc} < {abd}}|${{3.10} >level {3.9}}|${{2} <=level {2.0.0}}
body_checks = ${ mydomain ? yes, it is }|${mydomain : no}|${mydomain?a:b}|${ {x} != {y} :f}
mime_header_checks = first
mime_header_checks = second ${smtpd_banner}
"""
TRICKY_NAMES = ["smtpd_banner", "delay_notice_recipient", "bounce_notice_recipient",
                "error_notice_recipient", "2bounce_notice_recipient", "header_checks",
                "body_checks", "mime_header_checks"]


@needs_postconf
def test_tricky_main_cf_matches_postconf(tmp_path):
    proc = postconf(tmp_path, TRICKY_MAIN_CF, "-xh", *TRICKY_NAMES)
    assert proc.returncode == 0, proc.stderr
    expected = proc.stdout.splitlines()
    values, warnings = parse_main_cf(TRICKY_MAIN_CF, str(tmp_path / "main.cf"))
    assert [f"postconf: warning: {w}" for w in warnings] == [
        line for line in proc.stderr.splitlines() if "overriding" in line]
    values["mail_name"] = "Postfix"
    got = [squeeze(expand(values[name], values.get)) for name in TRICKY_NAMES]
    assert got == expected
    # Daemons see the raw whitespace that postconf squeezes.
    assert values["delay_notice_recipient"] == "one,    two,\tthree # four"


# -- $ expansion ---------------------------------------------------------------------------

EXPANSION_CASES = [
    "plain text", "$$", "a$$b", "$x", "${x}", "$(x)", "${x}y$x.z", "$x_y", "$y",
    "${x?yes}", "${y?yes}", "${x:no}", "${y:no}", "${x ? yes }", "${x?{ a b }}",
    "${x?{t}:{f}}", "${y?{t}:{f}}", "${x?{t}:f}", "${y?{t}:f g}", "${x??foo:{b}ar}",
    "${{1} == {01}}", "${{a} == {a} ? {eq} : {ne}}", "${{b} < {a}?{lt}:{ge}}",
    "${{$x} != {}}", "${{10} > {9}}", "${{10} >= {9x}}", "${{3.10} >level {3.9}}",
    "${{0} <level {1}?{old}:{new}}", "${{3.6.1} ==level {3.6.1}}", "${{$x}<={$x}}",
    "${x?${x?${x?deep}}}", "$(x?paren)", "${x:{a}}", "${ x }", "${xx}",
    # errors
    "$", "a $", "${x", "$(x", "${x?{a}b}", "${x?{a}:{b}c}", "${{a}}", "${{a} = {b}}",
    "${{a} ==}", "${{a} == {b} x}", "${{a} ==foo {b}}", "${{x} <level {1}}", "${x y}",
    "${x?{a}", "$-", "${}", "${{1}<{2}?{a}:{b}",
]


@needs_postconf
def test_expansion_forms_match_postconf(tmp_path):
    differences = []
    for case in EXPANSION_CASES:
        main_cf = f"x = value\ny =\nsmtpd_banner = {case}\n"
        proc = postconf(tmp_path, main_cf, "-xh", "smtpd_banner")
        values, _ = parse_main_cf(main_cf)
        try:
            got: str | None = squeeze(expand(values["smtpd_banner"], values.get))
        except MacroError:
            got = None
        expected = proc.stdout.rstrip("\n") if proc.returncode == 0 else None
        if got != expected:
            differences.append((case, expected, got))
    assert differences == []


def test_expansion_warnings_are_stocks():
    def warnings_of(text: str) -> list[str]:
        with pytest.raises(MacroError) as err:
            expand(text, {"x": "1"}.get)
        return err.value.warnings

    assert warnings_of("${x") == ['truncated macro reference: "${x"']
    assert warnings_of("a $") == ['empty macro name: "a $"']
    assert warnings_of("${x y}") == ['attribute name syntax error at: "...x>>> y"']
    assert warnings_of("${{a} = {b}}") == [
        '"==" or "!="" or "<"" or "<="" or ">="" or ">" expected at: "...a}>>>= {b}"']
    assert warnings_of("${{a} ==foo {b}}") == ['bad operator suffix at: "...==>>>foo"']
    assert warnings_of("${{a} == x}") == ['"{expression}" expected at: "...{a} ==>>> x"']
    assert warnings_of("${x?{a}:{b}c}") == ['unexpected input at: "...b}>>>c"']
    assert warnings_of("$(x?{a)") == ['unbalanced {} in attribute expression: "{a"']


def test_nesting_limit_is_one_hundred_levels():
    def chain(length: int) -> dict[str, str]:
        values = {f"p{i}": f"$p{i + 1}" for i in range(length)}
        values[f"p{length}"] = "end"
        return values

    # "$p0" -> ... -> "$p99" -> "end": the literal is the 101st nested call.
    ok = chain(99)
    assert expand("$p0", ok.get) == "end"
    too_deep = chain(100)
    with pytest.raises(MacroError, match="unreasonable macro call nesting"):
        expand("$p0", too_deep.get)
    with pytest.raises(MacroError, match="unreasonable macro call nesting"):
        expand("$a", {"a": "$b", "b": "$a"}.get)


@needs_postconf
def test_nesting_limit_matches_postconf(tmp_path):
    for length, fails in ((99, False), (100, True)):
        lines = ["smtpd_banner = $p0"] + [f"p{i} = $p{i + 1}" for i in range(length)]
        main_cf = "\n".join([*lines, f"p{length} = end", ""])
        proc = postconf(tmp_path, main_cf, "-xh", "smtpd_banner")
        assert (proc.returncode != 0) == fails
        values, _ = parse_main_cf(main_cf)
        if fails:
            with pytest.raises(MacroError) as err:
                expand(values["smtpd_banner"], values.get)
            assert f"postconf: warning: {err.value.warnings[0]}" in proc.stderr
        else:
            assert expand(values["smtpd_banner"], values.get) == proc.stdout.strip()


def test_compatibility_levels_compare_numerically_per_field():
    level = compat_level_from_string
    assert level("3.10") > level("3.9") > level("3") > level("2") > level("1") > level("0")
    assert level("3.6") == level("3.6.0")
    assert level("3.6.1") > level("3.6")
    for bad in ("", "3.", "3.x", "-1", "3.1024", "1.2.3.4", "x"):
        assert level(bad) is None, bad


NAMES = ["smtpd_banner", "delay_notice_recipient", "bounce_notice_recipient", "u1", "zz"]
HOLDERS = NAMES[:3]


def _values() -> st.SearchStrategy[str]:
    name = st.sampled_from(NAMES)
    text = st.text(alphabet="ab 1.", max_size=4)
    op = st.sampled_from(["==", "!=", "<", "<=", ">", ">=", "<level", ">=level"])

    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.builds(lambda n: f"${n}", name),
            st.builds(lambda n: f"${{{n}}}", name),
            st.builds(lambda n: f"$({n})", name),
            st.builds(lambda n, t: f"${{{n}?{t}}}", name, inner),
            st.builds(lambda n, t: f"${{{n}:{t}}}", name, inner),
            st.builds(lambda n, t, f: f"${{{n}?{{{t}}}:{{{f}}}}}", name, inner, inner),
            st.builds(lambda a, o, b: f"${{{{{a}}} {o} {{{b}}}}}", inner, op, inner),
            st.builds(lambda a, o, b, t, f: f"${{{{{a}}}{o}{{{b}}}?{{{t}}}:{{{f}}}}}",
                      inner, op, inner, inner, inner),
            st.lists(inner, max_size=3).map("".join),
        )

    atoms = st.one_of(text, st.just("$$"), st.sampled_from(["$", "{", "}", "?", ":"]))
    return st.recursive(atoms, extend, max_leaves=6)


@needs_postconf
@settings(max_examples=int(os.environ.get("PF_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(values=st.lists(_values(), min_size=4, max_size=4))
def test_expansion_agrees_with_postconf_on_generated_values(tmp_path, values):
    assignments = dict(zip([*HOLDERS, "u1"], values, strict=True))
    main_cf = "".join(f"{name} = {value}\n" for name, value in assignments.items())
    proc = postconf(tmp_path, main_cf, "-xh", *HOLDERS)
    raw, _ = parse_main_cf(main_cf)
    try:
        got: list[str] | None = [squeeze(expand(raw[name], raw.get)) for name in HOLDERS]
    except (MacroError, ConversionFatal):
        got = None  # postconf exits 1, or dies of SIGSEGV on unbounded recursion
    expected = proc.stdout.splitlines() if proc.returncode == 0 else None
    assert got == expected, main_cf


# -- the daemon's view: registration order, defaults, fatal texts ---------------------------

# Every case is (main.cf, extra qmgr argv). "@QUEUE@" becomes a real queue directory.
DAEMON_CASES: list[tuple[str, tuple[str, ...]]] = [
    ("", ()),
    ("compatibility_level = 3.6\n", ()),
    ("compatibility_level = 1\nmyhostname = foo\n", ()),
    ("mydomain = example.org\n", ()),
    ("myhostname = mx.example.net\nrelay_domains = $mydestination\n", ()),
    ("multi_instance_name = inst2\nmynetworks_style = host\n", ()),
    ("mynetworks_style = class\ninet_protocols = ipv4\n", ()),
    ("inet_protocols = ipv6\n", ()),
    ("inet_interfaces = loopback-only\n", ()),
    ("inet_interfaces = 127.0.0.1\nmynetworks_style = host\n", ()),
    ("mynetworks_style = subnet, host\n", ()),
    ("default_destination_concurrency_limit = $ipc_timeout\n", ()),
    ("queue_run_delay = $ipc_idle\nqmgr_clog_warn_time = $queue_run_delay\n", ()),
    ("queue_run_delay = 1m30s\nmaximal_queue_lifetime = 7\nbounce_queue_lifetime = 10\n", ()),
    ("qmgr_message_active_limit = 10\nqmgr_message_recipient_limit = 5\n", ()),
    ("default_destination_concurrency_limit = 3\n",
     ("-o", "default_destination_concurrency_limit = 7", "-o", "x=$myhostname")),
    ("default_destination_concurrency_positive_feedback = 1/concurrency\n", ()),
    ("in_flow_delay = 0\ndefault_recipient_limit = -5\n", ()),
    ("smtputf8_enable = ${{$compatibility_level} <level {3.6} ? {no} : {yes}}\n", ()),
    # registration-order pitfalls: fatal in the daemon, fine for postconf -x
    ("queue_run_delay = $transport_retry_time\n", ()),
    ("default_destination_concurrency_limit = $smtpd_client_connection_count_limit\n", ()),
    ("default_destination_concurrency_limit = $local_destination_concurrency_limit\n", ()),
    # conversions and bounds
    ("queue_run_delay = 5S\n", ()),
    ("queue_run_delay = 5 s\n", ()),
    ("queue_run_delay = -1\n", ()),
    ("queue_run_delay = 9999999999\n", ()),
    ("maximal_queue_lifetime = 101d\n", ()),
    ("minimal_backoff_time = 0\n", ()),
    ("in_flow_delay = 11\n", ()),
    ("qmgr_message_active_limit = 10x\n", ()),
    ("qmgr_message_active_limit = 99999999999\n", ()),
    ("qmgr_message_active_limit =\n", ()),
    ("qmgr_message_recipient_minimum = 0\n", ()),
    ("default_delivery_slot_discount = 101\n", ()),
    ("line_length_limit = 100\n", ()),
    ("disable_verp_bounces = maybe\n", ()),
    ("default_destination_concurrency_negative_feedback =\n", ()),
    ("default_verp_delimiters = +\n", ()),
    ("compatibility_level = 3.x\n", ()),
    ("syslog_facility = bogus\n", ()),
    ("myhostname = foo..bar\n", ()),
    ("myhostname = 12345\n", ()),
    ("mydomain = -bad.example\n", ()),
    ("relayhost = VM.LOCALDOMAIN\nmyhostname = vm.localdomain\n", ()),
    ("myorigin = a, b\n", ()),
    ("myorigin = /dev/null\n", ()),
    ("myorigin = /nonexistent/mailname\n", ()),
    ("x = ${a?{b}c} $\nqueue_run_delay = $x\n", ()),
    ("queue_run_delay = ${{1} <level {3.x}}\n", ()),
    ("queue_run_delay = ${{1} =< {3}}\n", ()),
    ("", ("-o", "novalue")),
    ("", ("-o", "= 5")),
]


@pytest.fixture(scope="module")
def stock_runs() -> list[StockRun]:
    if not HAVE_QMGR:
        pytest.skip("stock qmgr not runnable as root")
    cases = [(f"queue_directory = @QUEUE@\n{main_cf}", args, None)
             for main_cf, args in DAEMON_CASES]
    # qmgr started under its old name warns three times.
    nqmgr_dir = tempfile.mkdtemp(prefix="nqmgr")
    nqmgr = os.path.join(nqmgr_dir, "nqmgr")
    os.symlink(STOCK_QMGR, nqmgr)
    cases.append(("queue_directory = @QUEUE@\n", (), nqmgr))
    try:
        return run_stock_many(cases)
    finally:
        shutil.rmtree(nqmgr_dir)


def _compare_with_stock(main_cf: str, args: tuple[str, ...], stock: StockRun,
                        process_name: str = "qmgr") -> None:
    queue = os.path.join(stock.config_dir, "queue")
    text = f"queue_directory = {queue}\n{main_cf}"
    try:
        overrides = overrides_of(args)
    except ConfigError as exc:
        assert stock.fatal == str(exc)
        return
    result = mine(text, stock.config_dir, overrides, process_name)
    if isinstance(result, ConfigError):
        assert stock.fatal == str(result)
        assert stock.warnings == result.warnings
        return
    assert stock.fatal is None, f"stock: {stock.fatal}"
    assert stock.warnings == result.warnings
    ours = [(n, "PID" if n == "process_id" else v) for n, v in result.updates]
    theirs = [(n, "PID" if n == "process_id" else v) for n, v in stock.updates]
    assert ours == theirs


@needs_qmgr
@pytest.mark.parametrize("index", range(len(DAEMON_CASES)),
                         ids=[repr(c[0][:40] + " ".join(c[1])) for c in DAEMON_CASES])
def test_daemon_view_matches_stock_qmgr(stock_runs, index):
    """Registration trace (every default written, in order), warnings and fatal text."""
    main_cf, args = DAEMON_CASES[index]
    _compare_with_stock(main_cf, args, stock_runs[index])


@needs_qmgr
def test_old_name_nqmgr_warns_like_stock(stock_runs):
    stock = stock_runs[len(DAEMON_CASES)]
    _compare_with_stock("", (), stock, process_name="nqmgr")
    assert len(stock.warnings) == 3


@needs_qmgr
def test_every_startup_parameter_is_registered_in_stock_order(stock_runs):
    stock = stock_runs[0]
    registered = [name for name, _ in stock.updates
                  if name not in ("service_name", "queue_directory")]
    expected = [n for n in STARTUP_PARAMETERS if n != "queue_directory"]
    assert registered == expected


@needs_postconf
def test_postconf_disagrees_with_the_daemon_on_late_registered_names(tmp_path):
    main_cf = ("queue_run_delay = $transport_retry_time\n"
               "default_destination_concurrency_limit = $smtpd_client_connection_count_limit\n")
    proc = postconf(tmp_path, main_cf, "-xh", "queue_run_delay",
                    "default_destination_concurrency_limit")
    assert proc.stdout.split() == ["60s", "50"]
    # The int table is read before the time table, so that error comes first.
    with pytest.raises(ConfigError, match=r"^bad numerical configuration: default_dest"):
        QmgrConfig.from_text(main_cf, hostname="h")
    with pytest.raises(ConfigError, match=r"^parameter queue_run_delay: bad time value"):
        QmgrConfig.from_text(main_cf.splitlines()[0], hostname="h")


def test_typed_values_defaults_and_units():
    cfg = QmgrConfig.from_text("compatibility_level = 3.6\n", hostname="host")
    assert cfg.myhostname == "host.localdomain" and cfg.mydomain == "localdomain"
    assert cfg.get("myorigin") == "host.localdomain"
    assert cfg.smtputf8_enable is True
    assert cfg.queue_run_delay == 300 and cfg.maximal_queue_lifetime == 5 * 86400
    # qmgr_post_init(): ipc_timeout becomes qmgr_ipc_timeout, no use or idle limits.
    assert cfg.qmgr_ipc_timeout == 60 and cfg.ipc_timeout == 60
    assert cfg.get("ipc_timeout") == "3600s"
    assert cfg.max_use == 0 and cfg.max_idle == 0
    assert cfg.hash_queue_names == ["deferred", "defer"] and cfg.defer_transports == []
    assert cfg.default_process_limit == 100 and cfg.in_flow_delay == 1
    assert cfg.address_verify_pending_request_limit == 5000
    assert cfg.get("relay_domains") == "" and cfg.get("mynetworks_style") == "host"
    old = QmgrConfig.from_text("", hostname="host.example.com")
    assert old.smtputf8_enable is False and old.mydomain == "example.com"
    assert old.get("relay_domains") == "host.example.com, localhost.example.com, localhost"
    assert old.get("fast_flush_domains") == old.get("relay_domains")


@pytest.mark.parametrize(("value", "unit", "seconds"), [
    ("10", "s", 10), ("10s", "s", 10), ("2m", "s", 120), ("2h", "s", 7200),
    ("1d", "s", 86400), ("1w", "s", 604800), ("7", "d", 7 * 86400), ("1m30s", "s", 60),
    ("10sxyz", "s", 10), (" 5", "s", 5), ("+5", "s", 5), ("s", "s", 0), ("0", "d", 0),
    ("5S", "s", None), ("5 s", "s", None), ("-1", "s", None), ("", "s", None),
    ("abc", "s", None), ("99999999999", "s", None), ("3550w", "s", None),
    ("3549w", "s", 3549 * 604800),
])
def test_conv_time(value, unit, seconds):
    assert conv_time(value, unit) == seconds


def test_time_values_and_defer_transports():
    cfg = QmgrConfig.from_text(
        "queue_run_delay = 1m30s\nmaximal_queue_lifetime = 7\nbounce_queue_lifetime = 2\n"
        "transport_retry_time = 2h\ndefer_transports = smtp, relay\tslow,,\n", hostname="h")
    assert cfg.queue_run_delay == 60
    assert cfg.maximal_queue_lifetime == 7 * 86400 and cfg.bounce_queue_lifetime == 2 * 86400
    assert cfg.transport_retry_time == 7200
    assert cfg.defer_transports == ["smtp", "relay", "slow"]
    assert split_list(" a,b ,, c\r\n") == ["a", "b", "c"]


def test_post_init_adjustments():
    cfg = QmgrConfig.from_text("qmgr_message_active_limit = 10\n"
                               "qmgr_message_recipient_limit = 5\n"
                               "maximal_queue_lifetime = 1d\nbounce_queue_lifetime = 2d\n",
                               hostname="h")
    assert cfg.qmgr_message_recipient_limit == 10
    assert cfg.bounce_queue_lifetime == 86400
    assert cfg.warnings == [
        "qmgr_message_recipient_limit is smaller than qmgr_message_active_limit"
        " - adjusting qmgr_message_recipient_limit",
        "bounce_queue_lifetime is larger than maximal_queue_lifetime"
        " - adjusting bounce_queue_lifetime",
    ]


def test_overrides_replace_main_cf_and_are_expanded_like_it():
    cfg = QmgrConfig.from_text("default_destination_concurrency_limit = 3\n",
                               [("default_destination_concurrency_limit", "$hash_queue_depth"),
                                ("queue_run_delay", "${ipc_idle}")], hostname="h")
    assert cfg.default_destination_concurrency_limit == 1
    assert cfg.queue_run_delay == 5
    assert cfg.get("default_destination_concurrency_limit") == "1"
    assert option_nameval(" name = a  b ") == ("name", "a  b")
    with pytest.raises(ConfigError, match='^invalid "-o x" option value: missing'):
        option_nameval("x")


def test_service_name_is_set_after_overrides_and_process_name_before_main_cf():
    cfg = QmgrConfig.from_text("process_name = other\nservice_name = nope\n",
                               [("service_name", "nope2")], hostname="h")
    assert cfg.get("service_name") == "qmgr"
    assert cfg.get("process_name") == "other"
    assert any("overriding earlier entry: process_name=qmgr" in w for w in cfg.warnings)


def test_get_follows_registered_names_semantics():
    cfg = QmgrConfig.from_text("a = [$queue_run_delay][$not_a_param][$smtpd_banner]\n",
                               hostname="h")
    assert cfg.get("a") == "[300s][][]"
    assert cfg.get("smtpd_banner") == ""
    assert cfg.lookup("queue_run_delay") == "300s"
    assert cfg.lookup("default_destination_concurrency_limit") == "20"
    bad = QmgrConfig.from_text("a = ${b\n", hostname="h")
    with pytest.raises(ConfigError) as err:
        bad.get("a")
    assert str(err.value) == "dictionary mail_dict: macro processing error"
    assert err.value.warnings == ['truncated macro reference: "${b"']


def test_load_reads_config_dir_main_cf(tmp_path):
    (tmp_path / "main.cf").write_text("queue_run_delay = 7\n")
    cfg = QmgrConfig.load(str(tmp_path), [("transport_retry_time", "9")], check_accounts=False)
    assert cfg.queue_run_delay == 7 and cfg.transport_retry_time == 9
    assert cfg.get("config_directory") == str(tmp_path)
    with pytest.raises(ConfigError, match=r"^open .*/nope/main.cf: No such file"):
        QmgrConfig.load(str(tmp_path / "nope"))


def test_account_checks():
    with pytest.raises(ConfigError, match="parameter mail_owner: unknown user name value"):
        QmgrConfig("mail_owner = no-such-user-xyz\n", check_accounts=True, hostname="h")
    with pytest.raises(ConfigError, match="parameter mail_owner: user root has privileged"):
        QmgrConfig("mail_owner = root\n", check_accounts=True, hostname="h")
    with pytest.raises(ConfigError, match="specify the same user nobody"):
        QmgrConfig("mail_owner = nobody\n", check_accounts=True, hostname="h")


# -- transports ----------------------------------------------------------------------------


def test_transport_defaults_and_the_local_exception():
    cfg = QmgrConfig.from_text("", hostname="h")
    smtp = cfg.transport("smtp")
    assert (smtp.destination_concurrency_limit, smtp.destination_recipient_limit) == (20, 50)
    assert smtp.initial_destination_concurrency == 5
    assert (smtp.delivery_slot_cost, smtp.delivery_slot_loan, smtp.delivery_slot_discount,
            smtp.minimum_delivery_slots) == (5, 3, 50, 3)
    assert (smtp.recipient_limit, smtp.extra_recipient_limit) == (20000, 1000)
    assert (smtp.recipient_refill_limit, smtp.recipient_refill_delay) == (100, 5)
    assert (smtp.transport_rate_delay, smtp.destination_rate_delay) == (0, 0)
    assert smtp.failed_cohort_limit == 1
    local = cfg.transport("local")
    assert (local.destination_concurrency_limit, local.destination_recipient_limit) == (2, 1)
    assert local.initial_destination_concurrency == 2
    assert cfg.transport("smtp") is smtp
    # The fallbacks are registered under the transport's own names, as stock does.
    assert cfg.lookup("smtp_destination_concurrency_limit") == "20"
    assert cfg.lookup("smtp_destination_rate_delay") == "0s"


def test_relay_does_not_fall_back_to_smtp():
    cfg = QmgrConfig.from_text("smtp_destination_concurrency_limit = 4\n"
                               "default_destination_concurrency_limit = 9\n", hostname="h")
    assert cfg.transport("smtp").destination_concurrency_limit == 4
    assert cfg.transport("relay").destination_concurrency_limit == 9


def test_rate_delay_forces_limit_one_and_initial_follows_the_limit():
    cfg = QmgrConfig.from_text(
        "slow_destination_rate_delay = 1m\nslow_destination_concurrency_limit = 10\n"
        "small_destination_concurrency_limit = 3\n"
        "open_destination_concurrency_limit = 0\nopen_initial_destination_concurrency = 7\n",
        hostname="h")
    slow = cfg.transport("slow")
    assert (slow.destination_rate_delay, slow.destination_concurrency_limit) == (60, 1)
    assert slow.initial_destination_concurrency == 1
    assert cfg.transport("small").initial_destination_concurrency == 3
    unlimited = cfg.transport("open")
    assert (unlimited.destination_concurrency_limit,
            unlimited.initial_destination_concurrency) == (0, 7)


def test_transport_values_are_expanded_at_first_use():
    cfg = QmgrConfig.from_text(
        "default_destination_concurrency_limit = 8\n"
        "a_destination_concurrency_limit = $default_destination_concurrency_limit\n"
        "a_destination_recipient_limit = $a_destination_concurrency_limit\n"
        "a_extra_recipient_limit = $a_recipient_limit\n"
        "a_transport_rate_delay = 2\n"
        "a_recipient_refill_delay = 1m\n", hostname="h")
    a = cfg.transport("a")
    assert (a.destination_concurrency_limit, a.destination_recipient_limit) == (8, 8)
    # a_recipient_limit was registered (20000) just before a_extra_recipient_limit.
    assert a.extra_recipient_limit == 20000
    assert (a.transport_rate_delay, a.recipient_refill_delay) == (2, 60)


def test_bad_transport_value_is_fatal_only_at_first_lookup():
    cfg = QmgrConfig.from_text("bad_destination_concurrency_limit = lots\n"
                               "worse_recipient_refill_delay = 0\n"
                               "ugly_destination_rate_delay = 5x\n"
                               "odd_delivery_slot_discount = 101\n"
                               "neg_destination_concurrency_limit = -3\n"
                               "broken_destination_recipient_limit = ${x\n", hostname="h")
    with pytest.raises(ConfigError) as err:
        cfg.transport("bad")
    assert str(err.value) == "bad numerical configuration: bad_destination_concurrency_limit" \
                             " = lots"
    with pytest.raises(ConfigError, match=r"^invalid worse_recipient_refill_delay: 0 \(min 1\)"):
        cfg.transport("worse")
    with pytest.raises(ConfigError, match="^parameter ugly_destination_rate_delay: bad time"):
        cfg.transport("ugly")
    with pytest.raises(ConfigError, match="^invalid odd_delivery_slot_discount parameter value"):
        cfg.transport("odd")
    assert cfg.transport("neg").destination_concurrency_limit == -3  # min 0 is not checked
    with pytest.raises(ConfigError) as err:
        cfg.transport("broken")
    assert err.value.warnings == ['truncated macro reference: "${x"']
    assert cfg.warnings == []
    assert cfg.transport("smtp").destination_concurrency_limit == 20


def test_feedback_values_and_the_name_stock_would_warn_under():
    cfg = QmgrConfig.from_text(
        "default_destination_concurrency_positive_feedback = 1/concurrency\n"
        "slow_destination_concurrency_positive_feedback = 1/sqrt_concurrency\n"
        "same_destination_concurrency_positive_feedback = 1/concurrency\n"
        "ref_destination_concurrency_negative_feedback = "
        "$default_destination_concurrency_negative_feedback\n"
        "empty_destination_concurrency_negative_feedback =\n", hostname="h")
    smtp = cfg.transport("smtp")
    assert (smtp.positive_feedback, smtp.positive_feedback_name) == (
        "1/concurrency", "default_destination_concurrency_positive_feedback")
    assert (smtp.negative_feedback, smtp.negative_feedback_name) == (
        "1", "default_destination_concurrency_negative_feedback")
    slow = cfg.transport("slow")
    assert (slow.positive_feedback, slow.positive_feedback_name) == (
        "1/sqrt_concurrency", "slow_destination_concurrency_positive_feedback")
    # Set, but to the default's value: stock names the default parameter.
    same = cfg.transport("same")
    assert same.positive_feedback_name == "default_destination_concurrency_positive_feedback"
    assert cfg.transport("ref").negative_feedback_name == \
        "default_destination_concurrency_negative_feedback"
    with pytest.raises(ConfigError, match=r"^bad string length 0 < 1: empty_destination"):
        cfg.transport("empty")


# postconf knows <service>_* names only for services whose command is smtp, lmtp, ...
TRANSPORTS_MASTER_CF = """\
smtp      unix  -       -       n       -       -       smtp
relay     unix  -       -       n       -       -       smtp
lmtp      unix  -       -       n       -       -       lmtp
local     unix  -       n       n       -       -       local
discard   unix  -       -       n       -       -       discard
"""


@needs_postconf
def test_transport_values_match_postconf_where_postconf_knows_the_names(tmp_path):
    main_cf = ("default_destination_concurrency_limit = 7\n"
               "smtp_destination_concurrency_limit = 3\n"
               "relay_destination_rate_delay = 5\n"
               "lmtp_destination_recipient_limit = ${{$smtp_destination_concurrency_limit}"
               " < {4} ? {11} : {12}}\n"
               "discard_destination_concurrency_limit = 4\n")
    names = ["smtp_destination_concurrency_limit", "relay_destination_concurrency_limit",
             "relay_destination_rate_delay", "lmtp_destination_recipient_limit",
             "local_destination_concurrency_limit", "local_destination_recipient_limit",
             "discard_destination_concurrency_limit"]
    proc = postconf(tmp_path, main_cf, "-xh", *names, master_cf=TRANSPORTS_MASTER_CF)
    assert proc.returncode == 0, proc.stderr
    # postconf prints nothing for discard_*: discard has no such parameters.
    assert proc.stdout.split() == ["3", "7", "5", "11", "2", "1"]
    assert "discard_destination_concurrency_limit: unknown parameter" in proc.stderr
    cfg = QmgrConfig.from_text(main_cf, hostname="h")
    assert cfg.transport("smtp").destination_concurrency_limit == 3
    relay = cfg.transport("relay")
    # postconf shows relay's limit as 7, but the rate delay makes it 1 in qmgr.
    assert (relay.destination_concurrency_limit, relay.destination_rate_delay) == (1, 5)
    assert cfg.transport("lmtp").destination_recipient_limit == 11
    local = cfg.transport("local")
    assert (local.destination_concurrency_limit, local.destination_recipient_limit) == (2, 1)
    # ...and qmgr honours discard_destination_concurrency_limit all the same.
    assert cfg.transport("discard").destination_concurrency_limit == 4


def test_self_reference_through_a_relational_operand():
    # Stock has no error for this: postconf and qmgr die of SIGSEGV (3.7.11).
    with pytest.raises(ConversionFatal, match="unbounded macro recursion"):
        expand("$a", {"a": "${{$a} == {x}}"}.get)
    with pytest.raises(ConfigError, match="unbounded macro recursion"):
        QmgrConfig.from_text("queue_run_delay = ${{$queue_run_delay} == {x}}\n", hostname="h")
