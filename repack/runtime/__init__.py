"""Run bundles: ``load_bundle``, ``PackedLinear``, ``nvfp4_linear`` (a torch custom op) and ``patch_model``."""

from .layer import FusedLinear, LoadedBundle, PackedLinear, load_bundle, patch_model
from .op import nvfp4_linear, nvfp4_matmul

__all__ = ["FusedLinear", "LoadedBundle", "PackedLinear", "load_bundle", "nvfp4_linear", "nvfp4_matmul", "patch_model"]
