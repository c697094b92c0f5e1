"""``meshnode run`` with a test harness's hooks in the node (tests and benchmarks only).

    python harness/hooked_node.py [--stage-delays FILE] [--drafts FILE] run [meshnode run's flags]

``--stage-delays``: delays and faults in this node's stages' steps (harness/faults.py);
``--drafts``: scripted guesses for speculative decoding (harness/drafts.py). Both files are read
again as they change, so a test steers a running node by writing them. The hooks go in through the
node's constructor (meshnode.hooks.NodeHooks); the rest is meshnode's own command line, unchanged.
``harness.cluster.node_argv`` builds this command line when a test asks for either.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

HOOKS = ("--stage-delays", "--drafts")


def split_argv(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """The hooks' flags at the front of ``argv`` (by name, without dashes) and meshnode's arguments after them."""
    hooks, rest = {}, list(argv)
    while rest and rest[0] in HOOKS:
        if len(rest) < 2:
            raise SystemExit(f"{rest[0]} needs a file")
        hooks[rest[0][2:].replace("-", "_")] = rest[1]
        rest = rest[2:]
    return hooks, rest


def main(argv: Sequence[str] | None = None) -> int:
    import meshnode.node
    from harness.drafts import drafters_from_file
    from harness.faults import InjectedDelay
    from meshnode.cli import main as meshnode_main
    from meshnode.hooks import NodeHooks

    hooks, rest = split_argv(sys.argv[1:] if argv is None else argv)
    node_hooks = NodeHooks(
        stream_hook=InjectedDelay(hooks["stage_delays"]).stream if "stage_delays" in hooks else None,
        drafters=drafters_from_file(hooks["drafts"]) if "drafts" in hooks else None,
    )
    run_node = meshnode.node.run_node
    # `meshnode run` starts the node through run_node (imported when the command runs): with the hooks here.
    meshnode.node.run_node = lambda settings: run_node(settings, node_hooks)
    return meshnode_main(rest)


if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # run as a file: the repository, not harness/
    sys.exit(main())
