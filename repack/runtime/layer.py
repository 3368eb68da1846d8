"""Bundle-backed modules: ``PackedLinear``, ``load_bundle`` and ``patch_model``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..bundle.reader import Bundle, open_bundle
from ..errors import RepackError
from ..targets import RuntimeLayer
from .backends import choose_backend, prepare_backend
from .op import nvfp4_linear


class PackedLinear(nn.Module):
    """A linear layer whose weight is held in a target's runtime layout; forward runs ``nvfp4_linear``."""

    def __init__(self, runtime: RuntimeLayer, n: int, k: int, target: str, backend: str,
                 device: torch.device, bias: torch.Tensor | None = None,
                 transforms: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.n, self.k = n, k
        self.in_features, self.out_features = k, n
        self.target, self.backend = target, backend
        for name, tensor in runtime.tensors().items():
            self.register_buffer(name, tensor.to(device))
        for location in ("input", "output"):  # online transforms: x @ T_in before the GEMM, y @ T_out after
            matrix = (transforms or {}).get(location)
            self.register_buffer(f"{location}_transform", matrix.to(device) if matrix is not None else None)
        self.bias = nn.Parameter(bias.detach().to(device), requires_grad=False) if bias is not None else None
        self._prepared: Callable[[torch.Tensor], torch.Tensor] | None = None

    def prepared(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The backend bound to this layer's tensors (checked once), for eager calls; rebuilt after ``.to()``."""
        if self._prepared is None:
            self._prepared = prepare_backend(self.backend, self.weight, self.weight_scale, self.weight_global_scale,
                                             self.n, self.k, self.target)  # fmt: skip
        return self._prepared

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .half() ...: the buffers may be new tensors
        self._prepared = None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nvfp4_linear(x, self, self.bias)

    def extra_repr(self) -> str:
        shown = [f"{loc}_transform=[{m.shape[0]}]" for loc, m in
                 (("input", self.input_transform), ("output", self.output_transform)) if m is not None]
        return ", ".join([f"in_features={self.k}, out_features={self.n}, target={self.target}, "
                          f"backend={self.backend}", *shown])


@dataclass
class LoadedBundle:
    """A bundle opened for a device, with its backend chosen."""

    bundle: Bundle
    device: torch.device
    backend: str
    _matrices: dict[tuple[str, torch.dtype | None], torch.Tensor] = field(default_factory=dict, repr=False)

    def layer(self, prefix: str, bias: torch.Tensor | None = None, runtime: RuntimeLayer | None = None,
              dtype: torch.dtype | None = None) -> PackedLinear:
        """``prefix`` as a module on this device (``runtime``: its tensors, if already read). Its online-transform
        matrices are shared between layers and held in ``dtype`` (default: as stored, the source model's dtype)."""
        record = self.bundle.layer(prefix)
        runtime = runtime if runtime is not None else self.bundle.runtime_layer(prefix)
        transforms = {t.location: self.matrix(t.matrix, dtype) for t in record.transforms}
        return PackedLinear(runtime, record.n, record.k, self.bundle.target.name, self.backend, self.device, bias,
                            transforms)

    def matrix(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One online-transform matrix on this device, read once per dtype."""
        if (name, dtype) not in self._matrices:
            self._matrices[(name, dtype)] = self.bundle.transform_matrix(name).to(self.device, dtype)
        return self._matrices[(name, dtype)]


def load_bundle(path: str | Path | Bundle, device: str | torch.device = "cpu", backend: str | None = None) -> LoadedBundle:
    """Open a bundle for ``device``; errors if its target cannot run there (CPU always can, via ``reference``)."""
    bundle = path if isinstance(path, Bundle) else open_bundle(path)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RepackError("device cuda requested but CUDA is not available on this machine")
    chosen = choose_backend(bundle.target, device)
    return LoadedBundle(bundle, device, backend or chosen)


def patch_model(model: nn.Module, bundle: str | Path | Bundle | LoadedBundle, device: str | torch.device = "cpu") -> list[str]:
    """Swap ``model``'s quantized ``nn.Linear`` modules for ``PackedLinear`` and load the passthrough tensors.

    Returns the names of bundle tensors the model has no place for (e.g. W4A4 activation scales, which
    weight-only serving does not use).
    """
    loaded = bundle if isinstance(bundle, LoadedBundle) else load_bundle(bundle, device)
    manifest = loaded.bundle.manifest
    for prefix, record in manifest.layers.items():
        parent_name, _, child = prefix.rpartition(".")
        try:
            old = model.get_submodule(prefix)
        except AttributeError:
            raise RepackError(f"model has no module {prefix!r} for the bundle's layer") from None
        if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != (record.n, record.k):
            raise RepackError(f"{prefix}: model module {old} does not match bundle layer [N={record.n}, K={record.k}]")
        packed = loaded.layer(prefix, old.bias, dtype=old.weight.dtype)  # transforms in the model's dtype, as vLLM
        setattr(model.get_submodule(parent_name) if parent_name else model, child, packed)
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    unused = []
    with torch.no_grad():
        for name in manifest.passthrough:
            if name not in state:
                unused.append(name)
                continue
            value = loaded.bundle.read(name)
            if state[name].shape != value.shape:
                raise RepackError(f"{name}: bundle shape {list(value.shape)} != model shape {list(state[name].shape)}")
            state[name].copy_(value)
    return unused
