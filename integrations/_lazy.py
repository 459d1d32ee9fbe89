"""The install hint raised when a framework integration is imported without its framework."""

from __future__ import annotations

__all__ = ["missing_framework"]


def missing_framework(module: str, extra: str, requirement: str) -> ImportError:
    """An ImportError telling how to install what ``ragkv.integrations.<module>`` needs."""
    return ImportError(
        f"ragkv.integrations.{module} needs {requirement}, which is not installed; "
        f"install it with: pip install 'ragkv[{extra}]'"
    )
