"""Where the tools write (issue #31, finding 5): run as root from a directory others
can write to, ``compare``, ``replay`` and ``simulate --plot`` once followed a symbolic
link planted there and overwrote whatever it pointed at. Now an output directory
must be the user's own, writable by no one else, and no file is written through a
link. Real files, real links, the real command line; root to chown."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pyqmgr.output import OutputError, open_new, output_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYQMGR = [sys.executable, "-c", "import sys; from pyqmgr.cli import main; sys.exit(main())"]
OTHER = 54321

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown files")


@pytest.fixture
def shared(tmp_path):
    """A directory like /tmp: anyone writes, sticky; and a victim file outside it."""
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o1777)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    return d, victim


def test_an_output_directory_must_be_ones_own(shared, tmp_path):
    d, victim = shared
    fresh = d / "new" / "deeper"
    assert output_dir(str(fresh)) == str(fresh)
    assert (os.stat(fresh).st_mode & 0o777) == 0o755
    assert output_dir(str(fresh)) == str(fresh), "one's own, again"
    link = d / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(OutputError, match="a symbolic link; name a directory of your own"):
        output_dir(str(link))
    theirs = d / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(OutputError, match=f"belongs to uid {OTHER}, not to you"):
        output_dir(str(theirs))
    loose = d / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with pytest.raises(OutputError, match=r"others can write to it \(mode 0777\)"):
        output_dir(str(loose))
    (d / "file").write_text("")
    with pytest.raises(OutputError, match="not a directory"):
        output_dir(str(d / "file"))
    assert victim.read_text() == "precious\n"


def test_no_file_is_written_through_a_link(shared):
    d, victim = shared
    (d / "report.json").symlink_to(victim)
    with pytest.raises(OutputError, match="a symbolic link; not written"):
        with open_new(str(d / "report.json")) as f:
            f.write("owned")
    with open_new(str(d / "plain.json")) as f:
        f.write("{}")
    assert victim.read_text() == "precious\n"
    assert (os.stat(d / "plain.json").st_mode & 0o777) == 0o644


def run(args: list[str], cwd: str) -> subprocess.CompletedProcess[str]:
    # The checkout under test, whatever the current directory.
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([*PYQMGR, *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env, check=False)


def test_the_tools_refuse_a_planted_link_and_leave_its_target_alone(shared, tmp_path):
    d, victim = shared
    workload = os.path.join(ROOT, "compat", "workloads", "dead-mx.toml")
    # compare's default output under a shared current directory, planted first.
    (d / "pyqmgr-compare-dead-mx").symlink_to(tmp_path)
    proc = run(["compare", workload, "--with", "stock"], str(d))
    assert proc.returncode == 1, proc.stderr
    assert "pyqmgr compare: pyqmgr-compare-dead-mx: a symbolic link" in proc.stderr
    # replay --write-workload into a planted link.
    log = tmp_path / "mail.log"
    log.write_text(
        "Nov 24 10:00:00 mx postfix/qmgr[1]: AAAAAAAAAA: from=<a@b.example>, size=1, "
        "nrcpt=1 (queue active)\n"
        "Nov 24 10:00:01 mx postfix/smtp[2]: AAAAAAAAAA: to=<u@c.example>, "
        "relay=mx.c[192.0.2.1]:25, delay=1, delays=0/0/0/1, dsn=2.0.0, status=sent (250 ok)\n")
    (d / "wl").symlink_to(tmp_path)
    proc = run(["replay", str(log), "--year", "2026", "--write-workload", "wl"], str(d))
    assert proc.returncode == 1 and "pyqmgr replay: wl: a symbolic link" in proc.stderr, \
        proc.stderr
    assert not (tmp_path / "workload.toml").exists()
    # simulate --plot onto a planted link to the victim.
    (d / "plot.png").symlink_to(victim)
    scenario = os.path.join(ROOT, "scenarios", sorted(
        n for n in os.listdir(os.path.join(ROOT, "scenarios")) if n.endswith(".toml"))[0])
    proc = run(["simulate", scenario, "--plot", "plot.png"], str(d))
    if "pip install 'pyqmgr[plot]'" not in proc.stderr:
        assert proc.returncode == 1 and "plot.png: a symbolic link; not written" in \
            proc.stderr, proc.stderr
    assert victim.read_text() == "precious\n"


def test_a_directory_under_one_others_can_rename_in_is_refused(tmp_path):
    """A parent others can write to without the sticky bit lets them rename the output
    directory mid-run and put a link in its place: refused, whoever owns the output."""
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with pytest.raises(OutputError, match=r"can be written by others \(mode 0777, not "
                                          r"sticky\): another user could swap"):
        output_dir(str(loose / "out"))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(OutputError, match=f"belongs to uid {OTHER}: another user could"):
        output_dir(str(theirs / "out"))
    os.chmod(loose, 0o1777)
    assert output_dir(str(loose / "out")), "sticky, as /tmp: others cannot rename ours"
