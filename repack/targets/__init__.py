"""Target layouts: one module per GPU family, each a pure transform with its exact inverse.

This package is the one capability table (its rows in :mod:`.families`, each joined to its layout module's
functions): the CLI's ``targets`` command, runtime dispatch and the tests' skips all read it. Importing the
package loads no torch; the layouts (``TARGETS``, ``Target``, ...) are imported on first use, so the CLI starts
fast and reads the table without them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .families import FAMILIES, Family, family_for_capability, resolve_families, resolve_family, several_families

if TYPE_CHECKING:
    from .base import RuntimeLayer, Target, TensorSpec

_FROM_BASE = ("RuntimeLayer", "Target", "TensorSpec")


def __getattr__(name: str) -> object:
    """``TARGETS`` and the layout types, imported (with torch) when first asked for."""
    if name == "TARGETS":
        from . import marlin, sglang, sm90, sm100, sm120

        vllm = (sm100.TARGET, sm120.TARGET, sm90.TARGET, *marlin.TARGETS)  # each family's vLLM layouts...
        value: object = tuple(replace(t, variants=(*t.variants, *sglang.layouts(t))) for t in vllm)  # ...and SGLang's
    elif name in _FROM_BASE:
        from . import base

        value = getattr(base, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def resolve_target(name: str) -> Target:
    """The target called ``name`` (or one of its aliases), case-insensitive."""
    return _target(resolve_family(name))


def target_for_capability(major: int, minor: int) -> Target | None:
    """The target whose kernels run on compute capability ``major.minor``, if any."""
    family = family_for_capability(major, minor)
    return None if family is None else _target(family)


def _target(family: Family) -> Target:
    from . import TARGETS

    return next(t for t in TARGETS if t.name == family.name)


__all__ = ["FAMILIES", "TARGETS", "Family", "RuntimeLayer", "Target", "TensorSpec", "resolve_families",
           "resolve_family", "resolve_target", "several_families", "target_for_capability"]
