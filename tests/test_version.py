"""What a build says it is (meshnode.version), and which peers' protocols it accepts."""

from __future__ import annotations

import subprocess
from pathlib import Path

from meshnode import __version__
from meshnode.version import OLDEST_PROTOCOL, PROTOCOL, checkout_commit, commit, describe, incompatible

ROOT = Path(__file__).resolve().parent.parent


def test_a_checkout_names_its_commit_beside_the_release():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    if head.returncode != 0:  # an sdist or wheel: the release alone
        assert describe() == __version__
        return
    assert commit() and head.stdout.startswith(commit())
    assert describe() == f"{__version__}+g{commit()}"


def test_a_worktree_a_packed_ref_and_a_detached_head_name_their_commit(tmp_path):
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo, tree = tmp_path / "repo", tmp_path / "tree"
    (repo / ".git" / "refs" / "heads").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".git" / "refs" / "heads" / "main").write_text(sha + "\n")
    assert checkout_commit(repo) == sha[:9]
    # git worktree add: the worktree's own folder has HEAD; its branch is in the main repository's
    linked = repo / ".git" / "worktrees" / "tree"
    linked.mkdir(parents=True)
    (linked / "HEAD").write_text("ref: refs/heads/side\n")
    (linked / "commondir").write_text("../..\n")
    (repo / ".git" / "packed-refs").write_text(f"# pack-refs with: peeled\n{sha[::-1]} refs/heads/side\n")
    tree.mkdir()
    (tree / ".git").write_text(f"gitdir: {linked}\n")
    assert checkout_commit(tree) == sha[::-1][:9]
    (linked / "HEAD").write_text(sha + "\n")  # detached
    assert checkout_commit(tree) == sha[:9]
    assert checkout_commit(tmp_path) == ""  # no checkout


def test_every_protocol_in_the_range_is_accepted_and_builds_before_versions_too():
    for protocol in range(OLDEST_PROTOCOL, PROTOCOL + 1):
        assert incompatible("n2", "0.1.0", protocol) == ""
    assert incompatible("n2", "", 0) == ""  # a build from before protocols were announced


def test_a_protocol_outside_the_range_is_refused_naming_both_builds():
    why = incompatible("n2", "0.9.0+gabc", PROTOCOL + 1)
    assert why.startswith(f"n2 (meshnode 0.9.0+gabc) speaks wire protocol {PROTOCOL + 1}; ")
    assert f"this node (meshnode {describe()}) speaks {OLDEST_PROTOCOL} to {PROTOCOL}" in why
