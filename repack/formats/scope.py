"""Which of a model's linear modules a checkpoint's quantization covers, from its config alone, as vLLM decides.

compressed-tensors: a module that some config group's ``targets`` match (a module name, an ``re:`` regex, or the
class ``Linear``) and ``ignore`` does not. ModelOpt: every linear module but those ``exclude_modules``
(hf_quant_config.json) or config.json's ``ignore`` / ``exclude_modules`` name: wildcards (``fnmatch``), also
matched as substrings, as vLLM 0.33's ``ModelOptQuantConfigBase.is_layer_excluded`` does.
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Callable

from ..errors import RepackError
from .transforms import matches_module


def _strings(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RepackError(f"{where} must be a list of strings")
    return value


def quantized_linear(config: dict, hf_quant_config: dict | None = None) -> Callable[[str], bool] | None:
    """A predicate on a linear module's name: whether the checkpoint's quantization covers it; None when the
    config names no quantization method known here (nothing can then be said)."""
    qc = config.get("quantization_config")
    qc = qc if isinstance(qc, dict) else {}
    if qc.get("quant_method") == "compressed-tensors":
        groups = qc.get("config_groups")
        targets = [t for g in (groups.values() if isinstance(groups, dict) else []) if isinstance(g, dict)
                   for t in _strings(g.get("targets", []), "quantization_config.config_groups targets")]
        ignore = _strings(qc.get("ignore") or [], "quantization_config.ignore")
        return lambda name: (matches_module(name, targets, {name}, "quantization_config targets")
                             and not matches_module(name, ignore, {name}, "quantization_config.ignore"))
    if hf_quant_config is not None and isinstance(hf_quant_config.get("quantization"), dict):
        excluded = _strings(hf_quant_config["quantization"].get("exclude_modules") or [],
                            "hf_quant_config.json: exclude_modules")
    elif qc.get("quant_method") == "modelopt":
        excluded = _strings(qc.get("ignore", qc.get("exclude_modules")) or [], "quantization_config.ignore")
    else:
        return None
    return lambda name: not any(pattern in name or fnmatch(name, pattern) for pattern in excluded)
