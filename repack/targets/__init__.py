"""Target layouts: one module per GPU family, each a pure transform with its exact inverse.

This registry is the one capability table: the CLI's ``targets`` command, runtime dispatch and the
tests' skips all read it.
"""

from __future__ import annotations

from ..errors import RepackError
from . import sm90, sm100, sm120
from .base import RuntimeLayer, Target, TensorSpec

TARGETS: tuple[Target, ...] = (sm100.TARGET, sm120.TARGET, sm90.TARGET)


def resolve_target(name: str) -> Target:
    """The target called ``name`` (or one of its aliases), case-insensitive."""
    wanted = name.strip().lower()
    for target in TARGETS:
        if wanted in target.names:
            return target
    valid = ", ".join(n for t in TARGETS for n in t.names)
    raise RepackError(f"unknown target {name!r}; valid targets: {valid}")


def target_for_capability(major: int, minor: int) -> Target | None:
    """The target whose kernels run on compute capability ``major.minor``, if any."""
    for target in TARGETS:
        if (major, minor) in target.compute_capabilities:
            return target
    return None


__all__ = ["TARGETS", "RuntimeLayer", "Target", "TensorSpec", "resolve_target", "target_for_capability"]
