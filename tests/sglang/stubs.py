"""Import stubs for the SGLang oracle venv: packages SGLang imports at module level on paths that never run while it
loads an NVFP4 checkpoint, and that have no build for the CPU torch the venv pins (torchvision: CUDA builds only for
torch 2.13). Each stub module answers any attribute with a placeholder class; calling into one is a bug here."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("torchvision",)


class _Placeholder(type):
    """A class whose every attribute is another placeholder class (``InterpolationMode.BICUBIC``, ...)."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {"__module__": cls.__module__})


class _Stub(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Placeholder(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    """Stub :data:`STUBBED` (only where the package is not installed)."""
    from transformers.utils import import_utils

    for name in STUBBED:
        try:
            __import__(name)
        except ImportError:
            import_utils.is_torchvision_available()  # cached False first: transformers keeps off the stub
            sys.meta_path.append(_Finder())
            return
