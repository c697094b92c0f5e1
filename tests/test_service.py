"""meshnode install / uninstall: rendered plist and unit, install and uninstall into a temporary root."""

from __future__ import annotations

import io
import os
import plistlib
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from meshnode import cli, service
from meshnode.config import load_settings

EXE = Path(sys.executable)  # a real executable, as systemd-analyze verify wants for ExecStart


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in list(os.environ):
        if var.startswith("MESHNODE_"):
            monkeypatch.delenv(var)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


class Recorder:
    """Records commands instead of running them; fails those whose words include ``fail``."""

    def __init__(self, rc: int = 0, fail: str | None = None):
        self.calls: list[list[str]] = []
        self.rc, self.fail = rc, fail

    def __call__(self, argv):
        self.calls.append(list(argv))
        return 1 if self.fail in argv else self.rc


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("system", [False, True])
def test_plist_parses_and_runs_meshnode(tmp_path, system):
    lay = service.layout("macos", system=system, root=tmp_path, uid=501)
    data = plistlib.loads(service.render_plist(lay, "/opt/mesh venv/bin/meshnode").encode())
    assert data["Label"] == service.LABEL
    assert data["ProgramArguments"][-4:] == ["/opt/mesh venv/bin/meshnode", "run", "--config", str(lay.config_file)]
    assert data["RunAtLoad"] is True and data["KeepAlive"] is True
    assert data["ThrottleInterval"] >= 5
    assert data["StandardErrorPath"] == data["StandardOutPath"] == str(lay.log_file)
    if system:
        assert str(lay.log_file) == str(tmp_path / "Library/Logs/meshnode/meshnode.log")
        # the pid that newsyslog signals is the daemon's own: sh records $$ and then execs it
        assert data["ProgramArguments"][:2] == ["/bin/sh", "-c"]
        assert str(lay.pid_file) in data["ProgramArguments"][2] and 'exec "$@"' in data["ProgramArguments"][2]
        conf = service.render_newsyslog(lay)
        fields = [line.split() for line in conf.splitlines() if line and not line.startswith("#")]
        assert fields == [[str(lay.log_file), "root:wheel", "640", "5", "10240", "*", "J", str(lay.pid_file), "15"]]
    else:
        assert lay.service_file == tmp_path / "home/Library/LaunchAgents/org.meshnode.node.plist"
        assert lay.rotation_file is None and len(data["ProgramArguments"]) == 4


def _verify(unit_text: str, tmp_path: Path, user: bool) -> subprocess.CompletedProcess:
    folder = tmp_path / "units"
    folder.mkdir()
    unit = folder / service.UNIT
    unit.write_text(unit_text)
    env = dict(os.environ)
    if user:  # a user manager needs a runtime folder; verify builds one in-process
        runtime = tmp_path / "runtime"
        runtime.mkdir(mode=0o700)
        env["XDG_RUNTIME_DIR"] = str(runtime)
    argv = ["systemd-analyze", "verify", *(["--user"] if user else []), str(unit)]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (e.g. on a Mac); CI installs it (apt-get install systemd)",
)
@pytest.mark.parametrize("system", [False, True])
def test_unit_passes_systemd_analyze_verify(tmp_path, system):
    lay = service.layout("linux", system=system, root=tmp_path / "root with space")
    text = service.render_unit(lay, EXE)
    assert "Restart=always" in text and "RestartSec=" in text and "StartLimitBurst=" in text
    result = _verify(text, tmp_path, user=not system)
    assert result.returncode == 0, result.stderr
    # verify exits 0 even for unknown keys or bad values; it names the file when it finds any
    assert service.UNIT + ":" not in result.stderr, result.stderr
    assert "is not executable" not in result.stderr, result.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_verify_catches_a_missing_executable(tmp_path):
    """The check above has teeth: a unit whose ExecStart binary is missing fails verify."""
    lay = service.layout("linux", system=True, root=tmp_path)
    result = _verify(service.render_unit(lay, tmp_path / "no-such-meshnode"), tmp_path, user=False)
    assert result.returncode != 0


def test_exec_start_quotes_paths_with_spaces_and_specifiers(tmp_path):
    lay = service.layout("linux", system=True, root=tmp_path / "a b%c")
    line = next(x for x in service.render_unit(lay, "/opt/x y/meshnode").splitlines() if x.startswith("ExecStart="))
    assert line == f'ExecStart="/opt/x y/meshnode" run --config "{tmp_path}/a b%%c/etc/meshnode/meshnode.toml"'


# --------------------------------------------------------------------------- install, uninstall


def _install(lay, runner):
    out = io.StringIO()
    service.apply(service.plan_install(lay, EXE), runner=runner, out=out)
    return out.getvalue()


def _uninstall(lay, runner, purge=False):
    out = io.StringIO()
    service.apply(service.plan_uninstall(lay, purge=purge), runner=runner, uninstall=True, out=out)
    return out.getvalue()


def _check_config(lay) -> str:
    mode = stat.S_IMODE(lay.config_file.stat().st_mode)
    assert mode == 0o600, oct(mode)
    settings = load_settings(lay.config_file, env={})
    assert settings.cluster_key and len(settings.cluster_key) >= 32
    return settings.cluster_key


@pytest.mark.parametrize("platform,system", [("macos", False), ("macos", True), ("linux", False), ("linux", True)])
def test_install_then_uninstall(tmp_path, platform, system):
    root = tmp_path / "root"
    (root / "home").mkdir(parents=True)
    (root / "home" / "notes.txt").write_text("the user's own file")
    before = _files(root)
    lay = service.layout(platform, system=system, root=root, uid=501, user="ada")

    rec = Recorder()
    out = _install(lay, rec)
    config = str(lay.config_file.relative_to(root))
    unit = str(lay.service_file.relative_to(root))
    if platform == "macos":
        domain = "system" if system else "gui/501"
        expected_files = {config, unit} | ({"etc/newsyslog.d/meshnode.conf"} if system else set())
        expected_cmds = [
            ["launchctl", "enable", f"{domain}/org.meshnode.node"],
            ["launchctl", "bootstrap", domain, str(lay.service_file)],
        ]
        assert lay.log_file.parent.is_dir()  # launchd creates the log, not its folder
        assert plistlib.loads(lay.service_file.read_bytes())["ProgramArguments"][-3:] == [
            "run",
            "--config",
            str(lay.config_file),
        ]
    else:
        ctl = ["systemctl"] + ([] if system else ["--user"])
        expected_files = {config, unit}
        expected_cmds = [ctl + ["daemon-reload"], ctl + ["enable", "--now", "meshnode.service"]]
        if not system:
            expected_cmds.append(["loginctl", "enable-linger", "ada"])
        assert f"ExecStart={EXE} run --config {lay.config_file}" in lay.service_file.read_text()
    assert _files(root) - before == expected_files
    assert rec.calls == expected_cmds
    key = _check_config(lay)
    assert out.count(key) == 1  # shown once, on the install that made it

    # a second install (an upgrade) keeps the config and its key, and does not show the key again
    rec2 = Recorder()
    out2 = _install(lay, rec2)
    assert _check_config(lay) == key and key not in out2 and "keeping the existing config" in out2
    assert _files(root) - before == expected_files
    if platform == "macos":  # bootstrap refuses a loaded job: it is booted out first
        assert rec2.calls[0] == ["launchctl", "bootout", f"{domain}/org.meshnode.node"]
    else:  # enable --now leaves the old version running: restart it
        assert ctl + ["restart", "meshnode.service"] in rec2.calls

    # uninstall: the service goes, the config with the key stays (and the user is told)
    stop = "bootout" if platform == "macos" else "disable"
    rec3 = Recorder(fail=stop)  # stopping may fail (not loaded): uninstall goes on
    out3 = _uninstall(lay, rec3)
    assert _files(root) - before == {config}
    assert "kept the config" in out3 and key not in out3
    if platform == "macos":
        assert rec3.calls == [["launchctl", "bootout", f"{domain}/org.meshnode.node"]]
    else:
        assert rec3.calls == [ctl + ["disable", "--now", "meshnode.service"], ctl + ["daemon-reload"]]

    # --purge removes the config and the logs too: the file set is back to what it was
    if lay.log_file is not None:
        lay.log_file.write_text("a log line\n")
    _uninstall(lay, Recorder(), purge=True)
    assert _files(root) == before
    assert not lay.config_file.parent.exists()


def test_install_with_another_machines_key(tmp_path, capsys, monkeypatch):
    """The second machine joins the first's mesh: its key comes from MESHNODE_CLUSTER_KEY, is
    written (0600, exactly, whatever characters it has) and never printed."""
    key = 'first "machine" \\ key\twith odd characters'
    monkeypatch.setenv("MESHNODE_CLUSTER_KEY", key)
    lay = service.layout("linux", system=False, root=tmp_path, uid=501, user="ada")
    assert cli.main(["install", "--dry-run", "--platform", "linux", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "<the key given in MESHNODE_CLUSTER_KEY>" in out and key not in out and not lay.config_file.exists()

    out = io.StringIO()
    service.apply(service.plan_install(lay, EXE, cluster_key=key), runner=Recorder(), out=out)
    assert _check_config(lay) == key
    assert key not in out.getvalue() and "given in MESHNODE_CLUSTER_KEY" in out.getvalue()

    # an existing config keeps its key, and the user is told the variable was not used
    act = service.plan_install(lay, EXE, cluster_key="another key entirely")
    assert not any(path == lay.config_file for path, _, _ in act.write)
    assert any("MESHNODE_CLUSTER_KEY is not used" in n for n in act.notes)


def test_failing_command_stops_install(tmp_path):
    lay = service.layout("linux", system=True, root=tmp_path)
    with pytest.raises(service.CommandFailed, match="daemon-reload"):
        _install(lay, Recorder(rc=1))


def test_unknown_platform_in_layout():
    with pytest.raises(ValueError, match="unknown platform"):
        service.layout("windows")


# --------------------------------------------------------------------------- the command line


def test_cli_dry_run_macos_prints_plist_and_changes_nothing(tmp_path, capsys):
    assert cli.main(["install", "--dry-run", "--platform", "macos", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    start = out.index("<?xml")
    data = plistlib.loads(out[start : out.index("</plist>") + len("</plist>")].encode())
    assert data["ProgramArguments"][1:3] == ["run", "--config"] and data["KeepAlive"] is True
    assert "$ launchctl bootstrap gui/" in out and "$ launchctl enable gui/" in out
    assert "meshnode.toml (mode 0600)" in out
    assert list(tmp_path.iterdir()) == []


def test_cli_dry_run_linux_system_and_uninstall(tmp_path, capsys):
    assert cli.main(["install", "--dry-run", "--platform", "linux", "--system", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[Service]" in out and "$ systemctl enable --now meshnode.service" in out
    assert cli.main(["uninstall", "--dry-run", "--platform", "linux", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "$ systemctl --user disable --now meshnode.service" in out and "kept the config" in out
    assert list(tmp_path.iterdir()) == []


def test_cli_unknown_platform_is_a_usage_error(capsys):
    assert cli.main(["install", "--dry-run", "--platform", "windows"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_cli_other_platform_needs_dry_run(tmp_path, capsys):
    other = "linux" if service.host_platform() == "macos" else "macos"
    assert cli.main(["install", "--platform", other, "--root", str(tmp_path)]) == 2
    assert "needs --dry-run" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
