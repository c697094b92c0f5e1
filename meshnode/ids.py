"""The ids that cross the mesh's seams, told apart from other strings by the type checker."""

from __future__ import annotations

from typing import NewType

NodeId = NewType("NodeId", str)  # a node's lasting id (meshnode.identity)
ModelId = NewType("ModelId", str)  # a served model as the mesh names it: a Hub id or a folder's name
RequestId = NewType("RequestId", str)  # one generation, across every stage it runs on
