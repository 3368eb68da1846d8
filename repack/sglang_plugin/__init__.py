"""SGLang plugin (``pip install "nvfp4-repack[sglang]"``): serve a bundle with ``--load-format nvfp4_repack``.

SGLang runs :func:`register` in each of its processes (before parsing arguments, and in the scheduler) through the
``sglang.srt.plugins`` entry point. Only this subpackage imports SGLang.
"""

from __future__ import annotations

LOAD_FORMAT = "nvfp4_repack"
_registered = False


def register() -> None:
    """Accept ``--load-format nvfp4_repack`` and route it to :class:`.loader.BundleModelLoader` (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES, add_load_format_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .loader import route_load_format

    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    # SGLang has no loader registry, but get_model_loader instantiates a load_format that is a loader class (checked
    # before its ModelOpt branch): LoadConfig's check of the name hands it ours.
    HookRegistry.register("sglang.srt.configs.load_config.LoadConfig._verify_load_format", route_load_format,
                          HookType.AROUND)
    _registered = True
