"""The SGLang plugin's packaging: its entry point is the register function, and nothing but the plugin imports SGLang
(its state and refusals: tests/test_sglang_conformance.py)."""

from __future__ import annotations

from .conftest import assert_plugin_entry_point


def test_entry_point_is_the_register_function_and_the_core_never_imports_sglang():
    assert_plugin_entry_point("sglang.srt.plugins", "sglang")
