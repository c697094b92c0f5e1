"""meshnode's exceptions: one root, and the tree written down in meshnode.errors."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import meshnode
from meshnode import errors
from meshnode.errors import MeshnodeError
from meshnode.transport.refusals import StageError


def meshnode_exceptions() -> list[type[BaseException]]:
    """Every exception class a meshnode module defines."""
    found = {}
    for info in pkgutil.walk_packages(meshnode.__path__, "meshnode."):
        if info.name.endswith(".__main__"):  # runs the command
            continue
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == info.name:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


def test_every_meshnode_exception_derives_from_the_root_and_is_in_the_tree():
    classes = meshnode_exceptions()
    assert len(classes) > 30, "the walk found the modules"
    assert [c.__qualname__ for c in classes if not issubclass(c, MeshnodeError)] == []
    tree = errors.__doc__ or ""
    assert [c.__qualname__ for c in classes if not re.search(rf"\* (.*, )?{c.__qualname__}\b", tree)] == []


def test_the_builtins_callers_catch_stay_bases():
    from meshnode.config import ConfigError
    from meshnode.identity import IdentityError
    from meshnode.model.wire import WireError

    assert issubclass(ConfigError, ValueError) and issubclass(WireError, ValueError)
    assert issubclass(IdentityError, OSError) and issubclass(StageError, RuntimeError)
