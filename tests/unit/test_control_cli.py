"""pyqmgr status/explain when there is no daemon: a clear line and sysexits' status."""

from __future__ import annotations

import argparse
import json
import os
import shutil

import pytest

from pyqmgr import cli
from pyqmgr.cli import EX_UNAVAILABLE, main
from pyqmgr.control.protocol import COMMANDS, encode_request
from pyqmgr.control.render import SORTS, reply_lines, status_lines


@pytest.mark.skipif(shutil.which("postconf") is None, reason="needs postconf")
def test_no_daemon_running(tmp_path, capsys):
    (tmp_path / "main.cf").write_text(f"queue_directory = {tmp_path}/spool\n")
    os.mkdir(tmp_path / "spool")
    assert main(["status", "--config-dir", str(tmp_path)]) == EX_UNAVAILABLE
    err = capsys.readouterr().err
    assert err.startswith(f"pyqmgr status: cannot connect to {tmp_path}/spool/pyqmgr/control")
    assert "not running" in err
    assert main(["explain", "x.example", "--config-dir", str(tmp_path)]) == EX_UNAVAILABLE


@pytest.mark.skipif(shutil.which("postconf") is None, reason="needs postconf")
def test_not_a_config_directory(tmp_path, capsys):
    assert main(["status", "--config-dir", str(tmp_path / "none")]) == EX_UNAVAILABLE
    assert capsys.readouterr().err.startswith("pyqmgr status: ")


# -- the subcommands come from COMMANDS -------------------------------------------------

#: pyqmgr's subcommands that are no control channel command (top asks status itself).
NOT_CHANNEL_COMMANDS = {"demo", "check", "install", "uninstall", "simulate", "replay",
                        "compare", "top"}


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_is_a_subcommand_and_every_other_subcommand_is_known():
    subs = _subcommands()
    channel = set(subs) - NOT_CHANNEL_COMMANDS
    assert channel == set(COMMANDS), (
        "a COMMANDS entry without a pyqmgr subcommand, or a subcommand that is neither "
        "a COMMANDS entry nor listed in NOT_CHANNEL_COMMANDS")
    for name in COMMANDS:
        assert subs[name].get_default("func") is cli._command, name


def test_each_subcommand_has_its_commands_arguments():
    subs = _subcommands()
    for name, spec in COMMANDS.items():
        actions = {a.dest: a for a in subs[name]._actions}
        for arg_name, arg in [*spec.args.items(), *spec.view.items()]:
            action = actions[arg_name]
            assert (not action.option_strings) == arg.positional, (name, arg_name)
            assert action.help == arg.help and action.default == arg.default, (name, arg_name)
            if arg.parse is not None:
                assert action.type is cli.ARG_TYPES[arg.parse], (name, arg_name)
        assert {"config_dir", "json"} <= set(actions), name
        assert spec.help and spec.description, name


def test_status_sorts_are_the_renderers():
    assert COMMANDS["status"].view["sort"].choices == tuple(SORTS)


@pytest.mark.parametrize(("argv", "sent"), [
    (["status"], {}),
    (["explain", "x.example"], {"target": "x.example"}),
    (["jobs", "smtp"], {"transport": "smtp"}),
    (["jobs", "smtp", "--limit", "0"], {"transport": "smtp", "limit": 0}),
    (["suspend", "x.example"], {"target": "x.example", "ttl": 3600.0}),
    (["suspend", "smtp:", "--ttl", "2h", "--reason", "why"],
     {"target": "smtp:", "ttl": 7200.0, "reason": "why"}),
    (["resume", "x.example"], {"target": "x.example"}),
    (["retry", "x.example"], {"target": "x.example"}),
])
def test_what_each_subcommand_sends(monkeypatch, capsys, argv, sent):
    asked = []

    def ask(args, command, **request_args):
        asked.append((command, request_args))
        encode_request(command, **request_args)  # the daemon would take it
        return {"ok": True, "target": request_args.get("target")}

    monkeypatch.setattr(cli, "_ask", ask)
    assert cli.main([*argv, "--json"]) == 0
    assert asked == [(argv[0], sent)]
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_text_comes_from_the_renderer_with_the_view_options(monkeypatch, capsys):
    reply = {"ok": True, "messages": 0, "recipients": 0, "transports": [],
             "destinations": [{"name": "a", "window": 1}, {"name": "b", "window": 5}]}
    monkeypatch.setattr(cli, "_ask", lambda args, command, **kw: dict(reply))
    assert cli.main(["status", "--sort", "window"]) == 0
    assert capsys.readouterr().out == "\n".join(status_lines(reply, "window")) + "\n"


def test_a_command_without_text_of_its_own_is_shown_as_json():
    assert reply_lines("new-command", {"ok": True, "n": 1}) == ['{', '  "ok": true,',
                                                                '  "n": 1', '}']
