"""What a test harness puts into a node (harness/hooked_node.py); a node run as a service has none."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from meshnode.serving.drafting import DrafterFactory
from meshnode.transport.hop import StreamHook


@dataclasses.dataclass(frozen=True)
class NodeHooks:
    """Test-only behaviour, given to the node's constructor, never read from the environment."""

    stream_hook: StreamHook | None = None  # every data-port stream to a stage here
    drafters: Callable[[DrafterFactory], DrafterFactory] | None = None  # PlacementSettings.drafters
