"""Import ``"module:attribute"`` targets on first use, so registries need not import backends."""

from __future__ import annotations

import importlib
from typing import Any


def load_target(target: str) -> Any:
    """Return the attribute named by ``"package.module:Attribute"``.

    Raises:
        ImportError: the module (or a dependency of it) is not installed.
    """
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)
