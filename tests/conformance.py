"""Other projects' test suites run against a live node: the openai and anthropic SDKs' generated
resource tests (``tests/api_resources`` in their sdists) for the routes meshnode serves.

Each suite is the sdist of a fixed version, fetched once with ``pip download --no-binary :all:``
and unpacked into ``~/.cache/meshnode/suites/`` (``python -m tests.conformance`` does that ahead).
Its pytest runs in a subprocess in the sdist's folder, on the sdist's own copy of the SDK
(``src/`` first on the path), so the tests and the client they drive are of one version whatever
the venv holds. ``tests/suite_plugin/meshnode_suite.py`` points every request at the served model
and reports each case; ``tests/conformance_excluded.toml`` names the cases left out and why.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLUGIN_DIR = HERE / "suite_plugin"
EXCLUDED = HERE / "conformance_excluded.toml"
CACHE = Path(os.environ.get("MESHNODE_TEST_SUITES") or Path.home() / ".cache" / "meshnode" / "suites")


@dataclass(frozen=True)
class Suite:
    package: str
    version: str
    files: tuple[str, ...]  # the test files of the routes meshnode serves, relative to the sdist
    options: tuple[str, ...] = ()  # pytest options the suite's own configuration needs

    @property
    def name(self) -> str:
        return f"{self.package}-{self.version}"


SUITES = {
    "openai": Suite(
        "openai",
        "3.60.0",
        (
            "tests/api_resources/chat/test_completions.py",
            "tests/api_resources/test_completions.py",
            "tests/api_resources/test_models.py",
            "tests/api_resources/test_responses.py",
        ),
    ),
    "anthropic": Suite(
        "anthropic",
        "2.17.0",
        (
            "tests/api_resources/test_messages.py",
            "tests/api_resources/test_models.py",
        ),
        # pyproject's addopts, which "-o addopts=" drops: respx mocks httpx2 through this alias
        ("-p", "tests._alias_httpx"),
    ),
}


def fetch(suite: Suite) -> Path:
    """The unpacked sdist of ``suite``, fetched from the package registry the first time; a lock
    keeps parallel test workers from fetching it twice."""
    target = CACHE / suite.name
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{suite.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "pyproject.toml").is_file():
            return target
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
                + ["-d", tmp, f"{suite.package}=={suite.version}"],
                check=True,
                capture_output=True,
                timeout=600,
            )
            with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as sdist:
                sdist.extractall(tmp, filter="data")
            (Path(tmp) / suite.name).rename(target)
    return target


@dataclass
class Run:
    collected: list[str]  # every case's node id
    outcomes: dict[str, str]  # node id -> "passed", "failed" or "skipped"
    messages: dict[str, str]  # node id -> the failure's last line
    log: str

    def failed(self) -> list[str]:
        return [case for case, outcome in self.outcomes.items() if outcome == "failed"]


def run(suite: Suite, folder: Path, base_url: str, model: str, report: Path, *, host=None, timeout=1800.0) -> Run:
    """The suite's cases in ``files`` run against ``base_url`` (the node's ``/v1`` for openai, its
    root for anthropic), each request naming ``model``; one process, no workers of its own, inside
    ``host`` (a namespace host, harness/netns.py) if given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "PYTEST_"))}
    env.update(
        TEST_API_BASE_URL=base_url,
        MESHNODE_SUITE_MODEL=model,
        MESHNODE_SUITE_REPORT=str(report),
        PYTHONPATH=os.pathsep.join([str(folder / "src"), str(PLUGIN_DIR)]),
    )
    argv = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider"]
    argv += ["-p", "meshnode_suite", *suite.options, "--tb=line", *suite.files]
    if host is not None:
        argv = host.exec_args(argv)
    report.unlink(missing_ok=True)
    done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [json.loads(line) for line in report.read_text().splitlines()] if report.is_file() else []
    collected = next((line["collected"] for line in lines if "collected" in line), [])
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for line in lines:
        if "case" not in line:
            continue
        case, outcome = line["case"], line["outcome"]
        if outcome == "failed" or outcomes.get(case) is None:  # a failed setup or teardown fails the case
            outcomes[case] = outcome
        if line.get("message"):
            messages[case] = line["message"]
    return Run(collected, outcomes, messages, done.stdout[-20000:] + done.stderr[-5000:])


def excluded(name: str) -> list[tuple[str, str]]:
    """(pattern, reason) of every case of suite ``name`` left out; a pattern is an fnmatch one over
    node ids without their parameters (``[loose]``)."""
    entries = tomllib.loads(EXCLUDED.read_text()).get(name, [])
    return [(pattern, entry["reason"]) for entry in entries for pattern in entry["cases"]]


def reason_for(case: str, patterns: list[tuple[str, str]]) -> str | None:
    """Why ``case`` is left out, or None."""
    bare = case.split("[")[0]
    return next((reason for pattern, reason in patterns if fnmatch.fnmatchcase(bare, pattern)), None)


if __name__ == "__main__":
    for suite in SUITES.values():
        print(fetch(suite))


def problems(name: str, suite: Suite, folder: Path, result: Run) -> list[str]:
    """What keeps suite ``name``'s run from passing: a case not left out that did not pass, a case
    left out that passes, a pattern that matches no case, a file the suite no longer has."""
    patterns = excluded(name)
    found = [f"{f}: no such file in {suite.name}" for f in suite.files if not (folder / f).is_file()]
    if not result.collected:
        return [*found, f"no case collected:\n{result.log}"]
    bare = {case.split("[")[0] for case in result.collected}
    found += [f"{p}: matches no case of {suite.name}" for p, _ in patterns if not fnmatch.filter(bare, p)]
    for case in result.collected:
        outcome, reason = result.outcomes.get(case, "not run"), reason_for(case, patterns)
        if reason is None and outcome not in ("passed", "skipped"):  # a skip is the suite's own
            found.append(f"{case}: {outcome}: {result.messages.get(case, '')}")
        elif reason is not None and outcome == "passed":
            found.append(f"{case}: passes, but is left out ({reason})")
    return found
