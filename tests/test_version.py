"""What a build says it is (meshnode.version), and which peers' protocols it accepts."""

from __future__ import annotations

import subprocess
from pathlib import Path

from meshnode import __version__
from meshnode.version import OLDEST_PROTOCOL, PROTOCOL, commit, describe, incompatible

ROOT = Path(__file__).resolve().parent.parent


def test_a_checkout_names_its_commit_beside_the_release():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    if head.returncode != 0:  # an sdist or wheel: the release alone
        assert describe() == __version__
        return
    assert commit() and head.stdout.startswith(commit())
    assert describe() == f"{__version__}+g{commit()}"


def test_every_protocol_in_the_range_is_accepted_and_builds_before_versions_too():
    for protocol in range(OLDEST_PROTOCOL, PROTOCOL + 1):
        assert incompatible("n2", "0.1.0", protocol) == ""
    assert incompatible("n2", "", 0) == ""  # a build from before protocols were announced


def test_a_protocol_outside_the_range_is_refused_naming_both_builds():
    why = incompatible("n2", "0.9.0+gabc", PROTOCOL + 1)
    assert why.startswith(f"n2 (meshnode 0.9.0+gabc) speaks wire protocol {PROTOCOL + 1}; ")
    assert f"this node (meshnode {describe()}) speaks {OLDEST_PROTOCOL} to {PROTOCOL}" in why
