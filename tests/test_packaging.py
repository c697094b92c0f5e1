"""The built wheel carries what an installed meshnode needs at run time: the service templates
(kept in systemd_launchd/ at the top of the tree) and the dashboard's files.

The wheel is built with the venv's own setuptools (no build isolation, so nothing is downloaded;
the test extra pins setuptools>=68) from a copy of the sources, so the checkout is left untouched.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = sorted(p.name for p in (ROOT / "systemd_launchd").iterdir() if p.is_file())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("meshnode", "systemd_launchd"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = out.glob("meshnode-*.whl")
    return built


def test_wheel_ships_the_service_templates(wheel):
    assert TEMPLATES == ["meshnode.newsyslog.conf", "meshnode.plist", "meshnode.service"]
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for name in TEMPLATES:
            shipped = f"meshnode/service_templates/{name}"
            assert shipped in names, f"{shipped} is missing from {wheel.name}"
            assert zf.read(shipped) == (ROOT / "systemd_launchd" / name).read_bytes()
        assert not any(n.startswith("systemd_launchd/") for n in names)  # no stray top-level folder
        for static in ("index.html", "app.js", "style.css"):
            assert f"meshnode/api/static/{static}" in names


def test_installed_wheel_renders_the_service_from_its_own_templates(wheel, tmp_path):
    """Unpacked as pip would install it (a wheel is a zip of site-packages), outside the source
    tree and without the venv's site (-S: no editable install on the path): `meshnode install
    --dry-run` finds the templates inside the package."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from meshnode import cli, service\n"
        "print('TEMPLATES', service.templates_dir())\n"
        "sys.exit(cli.main(['install', '--dry-run', '--platform', sys.argv[2], '--root', sys.argv[3],\n"
        "                   '--executable', '/opt/meshnode/bin/meshnode']))\n"
    )
    for platform, marker in (
        ("linux", "ExecStart=/opt/meshnode/bin/meshnode run --config"),
        ("macos", "<string>/opt/meshnode/bin/meshnode</string>"),
    ):
        root = tmp_path / platform
        root.mkdir()
        result = subprocess.run(
            [sys.executable, "-S", "-c", code, str(site), platform, str(root)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr
        assert f"TEMPLATES {site / 'meshnode' / 'service_templates'}\n" in result.stdout
        assert marker in result.stdout
        assert list(root.iterdir()) == []  # a dry run changes nothing


def test_templates_missing_is_a_clear_error(tmp_path):
    """A copy of the package with neither templates folder says so instead of a traceback."""
    shutil.copytree(ROOT / "meshnode", tmp_path / "meshnode", ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from meshnode import cli\n"
        "sys.exit(cli.main(['install', '--dry-run', '--platform', 'linux', '--root', sys.argv[2],\n"
        "                   '--executable', '/x/meshnode']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", code, str(tmp_path), str(tmp_path / "root")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "service templates are neither in" in result.stderr and "Traceback" not in result.stderr
