"""The suite's time by test module, from a JUnit XML report (``pytest --junitxml``).

    .venv/bin/python scripts/suite_durations.py report.xml            # the table, slowest first
    .venv/bin/python scripts/suite_durations.py report.xml --write    # also tests/durations.json

tests/durations.json is what tests/conftest.py orders modules by, slowest first, so that parallel
workers start the longest modules at once instead of meeting them last.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).resolve().parent.parent / "tests" / "durations.json"


def module_seconds(report: Path) -> dict[str, tuple[float, int]]:
    """{module path: (seconds of setup, call and teardown, tests)} of every test case in ``report``."""
    out: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for case in ET.parse(report).iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is "tests.test_x" or "tests.test_x.TestClass"
        path = "/".join(module[:2]) + ".py" if len(module) >= 2 else case.get("file", "?")
        out[path][0] += float(case.get("time", 0))
        out[path][1] += 1
    return {path: (seconds, n) for path, (seconds, n) in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--write", action="store_true", help=f"write {DURATIONS.name}")
    args = parser.parse_args()
    seconds = module_seconds(args.report)
    total = sum(s for s, _ in seconds.values())
    print("| module | tests | seconds | share |\n|---|---:|---:|---:|")
    for path, (s, n) in sorted(seconds.items(), key=lambda kv: -kv[1][0]):
        print(f"| `{path}` | {n} | {s:.0f} | {100 * s / total:.1f} % |")
    print(f"| all | {sum(n for _, n in seconds.values())} | {total:.0f} | |")
    if args.write:
        rounded = {path: round(s, 1) for path, (s, _) in sorted(seconds.items())}
        DURATIONS.write_text(json.dumps(rounded, indent=1) + "\n")


if __name__ == "__main__":
    main()
