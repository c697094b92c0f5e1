"""Other projects' test suites run against a live node: the openai and anthropic SDKs' generated
resource tests (``tests/api_resources`` in their sdists) and llama.cpp's server tests (vendored in
llama-cpp-python's sdist, never built) for the routes meshnode serves.

Each suite is the sdist of a fixed version, fetched once with ``pip download --no-binary :all:``
and unpacked into ``~/.cache/meshnode/suites/`` (``python -m tests.conformance`` does that ahead).
Its pytest runs in a subprocess in the sdist's folder, on the sdist's own copy of the SDK
(``src/`` first on the path), so the tests and the client they drive are of one version whatever
the venv holds; llama.cpp's runs in its server tests' folder, the only part of its sdist unpacked,
on the venv's openai. ``tests/suite_plugin/meshnode_suite.py`` points every request at the served
model and reports each case; ``tests/conformance_excluded.toml`` names the cases left out and why.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import urllib.parse
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
    files: tuple[str, ...]  # the test files of the routes meshnode serves, relative to root
    options: tuple[str, ...] = ()  # pytest options the suite's own configuration needs
    root: str = ""  # the folder of the sdist its pytest runs in; only it is unpacked when given
    env: tuple[tuple[str, str], ...] = ()  # what the suite's own harness reads to target a running server
    run_left_out: bool = True  # False: the cases left out are skipped, not run and checked to fail

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
    "llama.cpp": Suite(
        "llama-cpp-python",
        "0.3.36",
        (
            "unit/test_basic.py",
            "unit/test_chat_completion.py",
            "unit/test_completion.py",
            "unit/test_compat_anthropic.py",
            "unit/test_compat_oai_responses.py",
            "unit/test_security.py",
            "unit/test_tool_call.py",
        ),
        ("-m", "not slow"),  # tests.sh's default: the slow cases download multi-GB models
        root="vendor/llama.cpp/tools/server/tests",
        # utils.ServerProcess then starts no llama-server and sends to the one it is told of
        env=(("DEBUG_EXTERNAL", "1"),),
        # most cases left out check SmolLM2's text against another model's: one could pass by chance
        run_left_out=False,
    ),
}


def fetch(suite: Suite) -> Path:
    """The unpacked sdist of ``suite``, fetched from the package registry the first time; a lock
    keeps parallel test workers from fetching it twice."""
    target = CACHE / suite.name
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{suite.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / suite.root / suite.files[0]).is_file():
            return target / suite.root
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
                + ["-d", tmp, f"{suite.package}=={suite.version}"],
                check=True,
                capture_output=True,
                timeout=600,
            )
            with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as sdist:
                members = sdist.getmembers()
                top = members[0].name.split("/")[0]  # the sdist's own folder, "llama_cpp_python-0.3.36"
                inside = f"{top}/{suite.root}/" if suite.root else ""
                members = [m for m in members if m.name.startswith(inside)]
                sdist.extractall(tmp, members=members, filter="data")
            shutil.rmtree(target, ignore_errors=True)
            (Path(tmp) / top).rename(target)
    return target / suite.root


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
    root for anthropic and llama.cpp), each request naming ``model``; one process, no workers of its
    own, inside ``host`` (a namespace host, harness/netns.py) if given."""
    drop = ("OPENAI_", "ANTHROPIC_", "PYTEST_", "LLAMA_", "DEBUG", "PORT", "N_GPU_LAYERS", "SLOW_TESTS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    url = urllib.parse.urlsplit(base_url)
    env.update(
        dict(suite.env),
        TEST_API_BASE_URL=base_url,
        MESHNODE_SUITE_HOST=url.hostname or "",
        MESHNODE_SUITE_PORT=str(url.port or 80),
        MESHNODE_SUITE_MODEL=model,
        MESHNODE_SUITE_REPORT=str(report),
        MESHNODE_SUITE_UNRUN=json.dumps(
            [] if suite.run_left_out else [[e.pattern, e.params] for e in excluded(name_of(suite))]
        ),
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


def name_of(suite: Suite) -> str:
    """The key of ``suite`` in SUITES and in tests/conformance_excluded.toml."""
    return next(name for name, known in SUITES.items() if known.name == suite.name)


@dataclass(frozen=True)
class LeftOut:
    pattern: str  # an fnmatch one over node ids without their parameters ("[loose]")
    reason: str
    params: tuple[str, ...] = ()  # fnmatch ones over the parameters' id ("messages7"); any if empty

    def covers(self, case: str) -> bool:
        bare, _, param = case.partition("[")
        chosen = not self.params or any(fnmatch.fnmatchcase(param[:-1], p) for p in self.params)
        return fnmatch.fnmatchcase(bare, self.pattern) and chosen


def excluded(name: str) -> list[LeftOut]:
    """Every case of suite ``name`` left out, with its reason."""
    entries = tomllib.loads(EXCLUDED.read_text()).get(name, [])
    return [
        LeftOut(pattern, entry["reason"], tuple(entry.get("params", ())))
        for entry in entries
        for pattern in entry["cases"]
    ]


def reason_for(case: str, left_out: list[LeftOut]) -> str | None:
    """Why ``case`` is left out, or None."""
    return next((entry.reason for entry in left_out if entry.covers(case)), None)


if __name__ == "__main__":
    for suite in SUITES.values():
        print(fetch(suite))


def problems(name: str, suite: Suite, folder: Path, result: Run) -> list[str]:
    """What keeps suite ``name``'s run from passing: a case not left out that did not pass, a case
    left out that passes, a pattern that matches no case, a file the suite no longer has."""
    left_out = excluded(name)
    found = [f"{f}: no such file in {suite.name}" for f in suite.files if not (folder / f).is_file()]
    if not result.collected:
        return [*found, f"no case collected:\n{result.log}"]
    for entry in left_out:
        if not any(entry.covers(case) for case in result.collected):
            found.append(f"{entry.pattern} {list(entry.params)}: matches no case of {suite.name}")
    for case in result.collected:
        outcome, reason = result.outcomes.get(case, "not run"), reason_for(case, left_out)
        if reason is None and outcome not in ("passed", "skipped"):  # a skip is the suite's own
            found.append(f"{case}: {outcome}: {result.messages.get(case, '')}")
        elif reason is not None and outcome == "passed":
            found.append(f"{case}: passes, but is left out ({reason})")
    return found
