"""``meshnode install`` / ``uninstall``: the node as a launchd job (macOS) or systemd unit (Linux).
Pure rendering and an injected ``runner``, so ``--dry-run`` and tests see exactly what runs. The
config holds the cluster key: created 0600, never overwritten."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import TextIO
from xml.sax.saxutils import escape

from meshnode.errors import MeshnodeError

__all__ = [
    "LABEL",
    "UNIT",
    "PLATFORMS",
    "Layout",
    "Command",
    "Action",
    "layout",
    "host_platform",
    "default_executable",
    "templates_dir",
    "render_plist",
    "render_unit",
    "render_newsyslog",
    "render_config",
    "plan_install",
    "plan_uninstall",
    "apply",
    "describe",
    "run_command",
]

LABEL = "org.meshnode.node"
UNIT = "meshnode.service"
PLATFORMS = ("macos", "linux")
THROTTLE_INTERVAL = 10  # launchd: seconds between restarts at the least
STOP_TIMEOUT = 20  # seconds to say goodbye before being killed
ROTATE_COUNT, ROTATE_SIZE_KIB = 5, 10240


def templates_dir() -> Path:
    """In the package (a wheel), else the source tree's systemd_launchd/."""
    package = Path(__file__).resolve().parent
    for folder in (package / "service_templates", package.parent / "systemd_launchd"):
        if (folder / "meshnode.service").is_file():
            return folder
    raise FileNotFoundError(
        f"the service templates are neither in {package / 'service_templates'} nor in "
        f"{package.parent / 'systemd_launchd'}: reinstall meshnode"
    )


def host_platform() -> str:
    """ "macos" or "linux"."""
    return "macos" if sys.platform == "darwin" else "linux"


def default_executable() -> Path:
    """The running installation's ``meshnode`` script (the venv's, not another on PATH)."""
    beside = Path(sys.executable).parent / "meshnode"
    if beside.exists():
        return beside
    found = shutil.which("meshnode")
    if found:
        return Path(found).resolve()
    raise FileNotFoundError("cannot find the meshnode executable: give --executable")


# --------------------------------------------------------------------------- paths


@dataclass(frozen=True)
class Layout:
    """Where everything goes for one platform and scope (per-user or system)."""

    platform: str
    system: bool
    service_file: Path  # the plist or the unit
    config_file: Path
    log_file: Path | None  # macOS only: Linux logs to the journal
    rotation_file: Path | None  # macOS system only: newsyslog.d entry
    pid_file: Path | None  # macOS system only: newsyslog signals it after rotating
    uid: int = 0
    user: str = ""

    @property
    def launchd_domain(self) -> str:
        return "system" if self.system else f"gui/{self.uid}"


def layout(
    platform: str,
    system: bool = False,
    root: Path | str = "/",
    home: Path | str | None = None,
    uid: int | None = None,
    user: str | None = None,
) -> Layout:
    """The paths for ``platform``; ``root`` and ``home`` move them (tests)."""
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}: expected one of {', '.join(PLATFORMS)}")
    root = Path(root)
    if home is None:
        home = Path.home() if root == Path("/") else root / "home"
    home = Path(home)
    uid = os.getuid() if uid is None else uid
    user = user or os.environ.get("USER") or home.name
    if platform == "macos":
        library = (root if system else home) / "Library"
        logs = library / "Logs" / "meshnode"
        return Layout(
            platform,
            system,
            service_file=library / ("LaunchDaemons" if system else "LaunchAgents") / f"{LABEL}.plist",
            config_file=library / "Application Support" / "meshnode" / "meshnode.toml",
            log_file=logs / "meshnode.log",
            rotation_file=root / "etc" / "newsyslog.d" / "meshnode.conf" if system else None,
            pid_file=root / "var" / "run" / "meshnode.pid" if system else None,
            uid=uid,
            user=user,
        )
    if system:
        return Layout(
            platform,
            True,
            service_file=root / "etc" / "systemd" / "system" / UNIT,
            config_file=root / "etc" / "meshnode" / "meshnode.toml",
            log_file=None,
            rotation_file=None,
            pid_file=None,
            uid=uid,
            user=user,
        )
    return Layout(
        platform,
        False,
        service_file=home / ".config" / "systemd" / "user" / UNIT,
        config_file=home / ".config" / "meshnode" / "meshnode.toml",
        log_file=None,
        rotation_file=None,
        pid_file=None,
        uid=uid,
        user=user,
    )


# --------------------------------------------------------------------------- rendering (pure)


def _template(name: str) -> Template:
    return Template((templates_dir() / name).read_text(encoding="utf-8"))


def program_arguments(executable: Path | str, config_file: Path | str) -> list[str]:
    """What the service runs: ``<meshnode> run --config <file>``."""
    return [str(executable), "run", "--config", str(config_file)]


def render_plist(lay: Layout, executable: Path | str) -> str:
    """The launchd plist. A LaunchDaemon starts via /bin/sh, which records its pid (kept by ``exec``)
    for newsyslog to signal after rotating the log."""
    args = program_arguments(executable, lay.config_file)
    if lay.pid_file is not None:
        args = ["/bin/sh", "-c", f"echo $$ > '{lay.pid_file}' && exec \"$@\"", "meshnode", *args]
    items = "\n".join(f"\t\t<string>{escape(a)}</string>" for a in args)
    return _template("meshnode.plist").substitute(
        label=LABEL,
        program_arguments=items,
        throttle_interval=THROTTLE_INTERVAL,
        stop_timeout=STOP_TIMEOUT,
        log_file=escape(str(lay.log_file)),
    )


def _systemd_quote(arg: str) -> str:
    """One ExecStart word: specifiers (%) and variables ($) escaped, quoted when it has spaces."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if any(c in arg for c in " \t\"'\\;"):
        arg = '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def render_unit(lay: Layout, executable: Path | str) -> str:
    """The systemd unit."""
    exec_start = " ".join(_systemd_quote(a) for a in program_arguments(executable, lay.config_file))
    return _template("meshnode.service").substitute(
        exec_start=exec_start,
        stop_timeout=STOP_TIMEOUT,
        wanted_by="multi-user.target" if lay.system else "default.target",
        journal_scope="" if lay.system else "--user ",
        # a user manager has no network-online.target: only a system unit can wait for the network
        network_dependency="Wants=network-online.target\nAfter=network-online.target\n" if lay.system else "",
    )


def render_newsyslog(lay: Layout) -> str:
    """The newsyslog.d entry rotating a LaunchDaemon's log (fields split on white space, so the
    paths have none)."""
    return _template("meshnode.newsyslog.conf").substitute(
        log_file=lay.log_file,
        pid_file=lay.pid_file,
        count=ROTATE_COUNT,
        size_kib=ROTATE_SIZE_KIB,
        label=LABEL,
    )


def render_config(cluster_key: str) -> str:
    """The daemon's config: the cluster key, all else default."""
    quoted = "".join(
        f"\\u{ord(c):04x}" if ord(c) < 32 or ord(c) == 127 else c
        for c in cluster_key.replace("\\", "\\\\").replace('"', '\\"')
    )  # a TOML basic string
    return (
        "# meshnode config, written by `meshnode install`. Every key, with its default, is documented\n"
        "# in configs/default.toml; add the ones you want to change here, then restart the service.\n"
        "\n"
        "# Shared secret of the mesh: give every machine the same key (keep this file private).\n"
        f'cluster_key = "{quoted}"\n'
    )


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    check: bool = True  # False: a failure may be expected (stopping what is not loaded)

    def __str__(self) -> str:
        import shlex

        return shlex.join(self.argv) + ("" if self.check else "   # may fail harmlessly")


@dataclass
class Action:
    """Files to write or remove and commands to run (install writes first; uninstall runs first)."""

    write: list[tuple[Path, str, int]] = field(default_factory=list)  # (path, text, mode)
    remove: list[Path] = field(default_factory=list)
    remove_dirs: list[Path] = field(default_factory=list)  # removed only when empty
    make_dirs: list[Path] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    then: list[Command] = field(default_factory=list)  # uninstall: after the files are removed
    cluster_key: str | None = None  # set when this install generates a new key
    notes: list[str] = field(default_factory=list)


def _systemctl(lay: Layout, *args: str, check: bool = True) -> Command:
    return Command(("systemctl", *([] if lay.system else ["--user"]), *args), check)


def plan_install(lay: Layout, executable: Path | str, dry_run: bool = False, cluster_key: str | None = None) -> Action:
    """Everything ``meshnode install`` does; a new config gets ``cluster_key`` or a fresh key."""
    act = Action()
    reinstall = lay.service_file.exists()
    if not lay.config_file.exists():
        if cluster_key:
            key = "<the key given in MESHNODE_CLUSTER_KEY>" if dry_run else cluster_key
            act.notes.append("the config holds the cluster key given in MESHNODE_CLUSTER_KEY")
        else:
            key = "<a new key, generated on install>" if dry_run else secrets.token_urlsafe(32)
            act.cluster_key = None if dry_run else key
        act.write.append((lay.config_file, render_config(key), 0o600))
    else:
        act.notes.append(f"keeping the existing config {lay.config_file} (and its cluster key)")
        if cluster_key:
            act.notes.append(
                "MESHNODE_CLUSTER_KEY is not used: the existing config keeps its own key "
                "(change cluster_key there, then restart the service)"
            )
    if lay.platform == "macos":
        assert lay.log_file is not None, "macOS's layout has a log file"
        act.make_dirs.append(lay.log_file.parent)
        act.write.append((lay.service_file, render_plist(lay, executable), 0o644))
        if lay.rotation_file is not None:
            act.write.append((lay.rotation_file, render_newsyslog(lay), 0o644))
        target = f"{lay.launchd_domain}/{LABEL}"
        if reinstall:  # bootstrap refuses a job that is already loaded
            act.commands.append(Command(("launchctl", "bootout", target), check=False))
        act.commands += [
            Command(("launchctl", "enable", target)),
            Command(("launchctl", "bootstrap", lay.launchd_domain, str(lay.service_file))),
        ]
    else:
        act.write.append((lay.service_file, render_unit(lay, executable), 0o644))
        act.commands += [_systemctl(lay, "daemon-reload"), _systemctl(lay, "enable", "--now", UNIT)]
        if reinstall:  # enable --now leaves a running old version running
            act.commands.append(_systemctl(lay, "restart", UNIT))
        if not lay.system:  # without lingering, user services stop at logout
            act.commands.append(Command(("loginctl", "enable-linger", lay.user), check=False))
    return act


def plan_uninstall(lay: Layout, purge: bool = False) -> Action:
    """Everything ``meshnode uninstall`` does; the config and logs stay unless ``purge``."""
    act = Action()
    if lay.platform == "macos":
        act.commands.append(Command(("launchctl", "bootout", f"{lay.launchd_domain}/{LABEL}"), check=False))
        act.remove += [p for p in (lay.service_file, lay.rotation_file, lay.pid_file) if p is not None]
    else:
        act.commands += [_systemctl(lay, "disable", "--now", UNIT, check=False)]
        act.remove.append(lay.service_file)
        act.then.append(_systemctl(lay, "daemon-reload"))  # forget the removed unit
        if not lay.system:
            act.notes.append(f"lingering stays on for {lay.user} (`loginctl disable-linger {lay.user}` turns it off)")
    if purge:
        act.remove.append(lay.config_file)
        act.remove_dirs.append(lay.config_file.parent)
        if lay.log_file is not None:
            act.remove += [p for p in sorted(lay.log_file.parent.glob("meshnode.log*"))]
            act.remove_dirs.append(lay.log_file.parent)
    else:
        act.notes.append(f"kept the config {lay.config_file} with the cluster key (--purge removes it)")
        if lay.log_file is not None:
            act.notes.append(f"kept the logs in {lay.log_file.parent} (--purge removes them)")
    return act


# --------------------------------------------------------------------------- doing it

Runner = Callable[[Sequence[str]], int]


def run_command(argv: Sequence[str]) -> int:
    """Runs the command on the terminal; returns the exit status."""
    try:
        return subprocess.run(list(argv), check=False).returncode
    except FileNotFoundError:
        return 127


def _write_private_or_plain(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode == 0o600:  # created 0600 from the start and never overwritten: it holds the cluster key
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(path, 0o600)  # whatever the umask
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.chmod(tmp, mode)
    os.replace(tmp, path)


class CommandFailed(MeshnodeError, RuntimeError):
    """A service manager's command exited non-zero; the message names it and its status."""


def apply(act: Action, runner: Runner = run_command, uninstall: bool = False, out: TextIO | None = None) -> None:
    """Carry out a plan."""
    out = out if out is not None else sys.stdout

    def run_all(commands: list[Command]) -> None:
        for cmd in commands:
            print(f"$ {' '.join(cmd.argv)}", file=out)
            rc = runner(cmd.argv)
            if rc != 0 and cmd.check:
                raise CommandFailed(f"`{' '.join(cmd.argv)}` failed with exit status {rc}")

    if uninstall:
        run_all(act.commands)
        for path in act.remove:
            if path.exists() or path.is_symlink():
                path.unlink()
                print(f"removed {path}", file=out)
        for d in act.remove_dirs:
            try:
                d.rmdir()
            except OSError:
                pass  # not there, or holds something install did not write (e.g. the node id)
        run_all(act.then)
    else:
        for d in act.make_dirs:
            d.mkdir(parents=True, exist_ok=True)
        for path, text, mode in act.write:
            _write_private_or_plain(path, text, mode)
            print(f"wrote {path}", file=out)
        run_all(act.commands + act.then)
    for note in act.notes:
        print(note, file=out)
    if act.cluster_key:
        print("\nThe cluster key of this mesh (shown only this once; it is kept in the config):\n", file=out)
        print(f"    {act.cluster_key}\n", file=out)
        print('Put the same key into the config of every other machine (cluster_key = "...")', file=out)


def describe(act: Action, uninstall: bool = False) -> str:
    """The dry run's text: every file, removal and command, in order."""
    lines: list[str] = []
    files = [f"# remove {p}" for p in act.remove] + [f"# remove {d} if empty" for d in act.remove_dirs]
    for d in act.make_dirs:
        lines.append(f"# create folder {d}")
    for path, text, mode in act.write:
        lines += [f"# write {path} (mode {mode:04o})", text.rstrip("\n"), ""]
    cmds, then = [f"$ {c}" for c in act.commands], [f"$ {c}" for c in act.then]
    lines += (cmds + files + then) if uninstall else cmds + then
    lines += [f"# {n}" for n in act.notes]
    return "\n".join(lines) + "\n"
