"""Bundle-backed modules: ``PackedLinear``, ``FusedLinear``, ``load_bundle`` and ``patch_model``."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..bundle.layers import VLLM_FUSION
from ..bundle.reader import Bundle, open_bundle
from ..errors import RepackError
from ..targets import RuntimeLayer
from ..targets.w4a4 import LAYOUT_ID as W4A4_LAYOUT
from ..targets.w4a4 import qutlass_scales
from .backends import choose_backend, fuses_input_transform, prepare_backend
from .backends.reference import w4a4_scales
from .op import nvfp4_linear
from .transforms import walsh_factors


class PackedLinear(nn.Module):
    """A linear layer whose weight is held in a target's runtime layout; forward runs ``nvfp4_linear``."""

    def __init__(self, runtime: RuntimeLayer, n: int, k: int, target: str, backend: str,
                 device: torch.device, bias: torch.Tensor | None = None,
                 transforms: dict[str, torch.Tensor] | None = None, qutlass: bool = False,
                 output_parts: list[tuple[int, int, torch.Tensor]] | None = None) -> None:
        super().__init__()
        self.n, self.k = n, k
        self.in_features, self.out_features = k, n
        self.target, self.backend = target, backend
        for name, tensor in runtime.tensors().items():
            self.register_buffer(name, tensor.to(device))
        if qutlass:  # a W4A4 layer vLLM serves through QuTLASS: its GEMM scalars, as vLLM computes them after loading
            alpha, scale = qutlass_scales(runtime.weight_global_scale)
            self.register_buffer("fused_alpha", alpha.to(device))
            self.register_buffer("fused_global_scale", scale.to(device))
        for location in ("input", "output"):  # online transforms: x @ T_in before the GEMM, y @ T_out after
            matrix = (transforms or {}).get(location)
            self.register_buffer(f"{location}_transform", matrix.to(device) if matrix is not None else None)
        # output transforms per partition (rows [start, stop), each its own matrix), where not on the whole layer
        self.output_rows = [(start, stop) for start, stop, _ in output_parts or ()]
        for i, (_, _, matrix) in enumerate(output_parts or ()):
            self.register_buffer(f"output_transform_{i}", matrix.to(device))
        self.bias = nn.Parameter(bias.detach().to(device), requires_grad=False) if bias is not None else None
        self._fuses_input = fuses_input_transform(backend, self.input_transform)  # a shape fact: fixed by .to()
        # its Walsh-Hadamard factors, read once from the matrix here (never in a traced or captured call)
        self._walsh = walsh_factors(self.input_transform) if self._fuses_input else None
        self._prepared: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def output_parts(self) -> list[tuple[int, int, torch.Tensor]]:
        """The per-partition output transforms: ``(start, stop, matrix)`` each (:func:`rows_transform`)."""
        return [(start, stop, getattr(self, f"output_transform_{i}"))
                for i, (start, stop) in enumerate(self.output_rows)]

    @property
    def fused_input_transform(self) -> torch.Tensor | None:
        """The input transform when the backend applies it inside its kernels (``fuses_input_transform``)."""
        return self.input_transform if self._fuses_input else None

    @property
    def input_walsh_key(self) -> str:
        """The fused input transform's ``WalshFactors.key`` ("" if it has none): the custom op's ``input_walsh``."""
        return self._walsh.key() if self._walsh is not None else ""

    def prepared(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The backend bound to this layer's tensors (checked once), for eager calls; rebuilt after ``.to()``."""
        if self._prepared is None:
            self._prepared = prepare_backend(self.backend, self.weight, self.weight_scale, self.gemm_scale,
                                             self.n, self.k, self.target, self.fused_input_transform,
                                             self._walsh)  # fmt: skip
        return self._prepared

    @property
    def gemm_scale(self) -> torch.Tensor:
        """What the backends take as ``weight_global_scale``: the multiplier, or for a W4A4 layer (which has an
        ``alpha``) its ``[alpha, input_global_scale_inv]``; QuTLASS's ``[fused_alpha, fused_global_scale]`` where
        vLLM serves the layer through it (its quantizer ignores the checkpoint's activation scale)."""
        if hasattr(self, "fused_alpha"):
            return w4a4_scales(self.fused_alpha, self.fused_global_scale)
        alpha = getattr(self, "alpha", None)
        if alpha is None or self.target != W4A4_LAYOUT:  # Marlin's W4A4 variant: weight-only, its alpha unused
            return self.weight_global_scale
        return w4a4_scales(alpha, self.input_global_scale_inv)

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .half() ...: the buffers may be new tensors
        self._prepared = None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nvfp4_linear(x, self, self.bias)

    def extra_repr(self) -> str:
        shown = [f"{loc}_transform=[{m.shape[0]}]" for loc, m in
                 (("input", self.input_transform), ("output", self.output_transform)) if m is not None]
        shown += [f"output_transform[{start}:{stop}]=[{m.shape[0]}]" for start, stop, m in self.output_parts]
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
        transforms = {t.location: self.matrix(t.matrix, dtype) for t in record.transforms if t.partitions is None}
        parts = [(start, stop, self.matrix(t.matrix, dtype)) for t in record.transforms if t.partitions is not None
                 for start, stop in record.output_rows(t)]
        return PackedLinear(runtime, record.n, record.k, self.bundle.target.layout_key, self.backend, self.device, bias,
                            transforms, self.bundle.runs_qutlass(prefix), parts)

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


class FusedLinear(nn.Module):
    """One ``PackedLinear`` holding several of the model's modules as its rows (q/k/v_proj, as vLLM's qkv_proj):
    one GEMM where the model makes two or three on the same input, and one kernel launch.

    The model keeps calling its own modules, now ``FusedSlice``s: the first member called on an input runs the
    GEMM, the others take their columns of that output (views). A member called on another input, or twice,
    runs the GEMM again, so any call order is right; Llama's (q, k, v on one ``hidden_states``) runs it once.
    The output is dropped once every member has taken its columns: nothing is held between forwards.
    """

    def __init__(self, layer: PackedLinear, sizes: list[int]) -> None:
        super().__init__()
        self.layer = layer
        ends = list(accumulate(sizes))
        self.bounds = [(end - size, end) for size, end in zip(sizes, ends)]
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._waiting: tuple[int, ...] = ()

    def columns(self, member: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input or member not in self._waiting:
            self._input, self._output, self._waiting = x, self.layer(x), tuple(range(len(self.bounds)))
        output = self._output
        self._waiting = tuple(i for i in self._waiting if i != member)
        if not self._waiting:
            self._input = self._output = None
        start, stop = self.bounds[member]
        return output[..., start:stop]


class FusedSlice(nn.Module):
    """A model module that is part of a ``FusedLinear`` (which its owner holds, as ``qkv_proj`` / ``gate_up_proj``):
    its columns of the fused output."""

    def __init__(self, fused: FusedLinear, member: int, k: int) -> None:
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a submodule: the owner's, once in state_dict and .to()
        self.member = member
        start, stop = fused.bounds[member]
        self.in_features, self.out_features = k, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.columns(self.member, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, member {self.member} of the fused layer"


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _model_linear(model: nn.Module, prefix: str, n: int, k: int) -> nn.Linear:
    try:
        old = model.get_submodule(prefix)
    except AttributeError:
        raise RepackError(f"model has no module {prefix!r} for the bundle's layer") from None
    if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != (n, k):
        raise RepackError(f"{prefix}: model module {old} does not match bundle layer [N={n}, K={k}]")
    return old


def _stacked_bias(olds: list[nn.Linear]) -> torch.Tensor | None:
    if all(old.bias is None for old in olds):
        return None
    ref = next(old.bias for old in olds if old.bias is not None)
    return torch.cat([old.bias if old.bias is not None else ref.new_zeros(old.out_features) for old in olds])


def _install_fused(model: nn.Module, name: str, members: list[str], layer: PackedLinear, k: int) -> None:
    fused = FusedLinear(layer, [model.get_submodule(m).out_features for m in members])
    _set_module(model, name, fused)
    for i, member in enumerate(members):
        _set_module(model, member, FusedSlice(fused, i, k))


def _runtime_fusions(manifest) -> list[tuple[str, list[str]]]:
    """``(fused name, members)`` for each unfused q/k/v and gate/up group of the bundle that can run as one layer:
    same K and multiplier (vLLM's rule for its fused modules; the producers write them so), no online transform."""
    groups = []
    for prefix in manifest.layers:
        for fused, parts in VLLM_FUSION.items():
            if not prefix.endswith("." + parts[0]):
                continue
            owner = prefix[: -len(parts[0])]
            members = [owner + part for part in parts]
            records = [manifest.layers.get(m) for m in members]
            if (all(r is not None and not r.transforms and [p.source for p in r.partitions] == [m]
                    for r, m in zip(records, members))
                    and len({(r.k, r.global_scale) for r in records}) == 1):  # fmt: skip
                groups.append((owner + fused, members))
    return groups


def _check_covered(model: nn.Module, bundle: Bundle) -> None:
    """Every linear of ``model`` that the bundle's quantization config quantizes must be held by the bundle (or be
    part of one of its layers): a model with more decoder layers than the bundle's source would otherwise keep
    its own (random) weights there."""
    quantized = bundle.quantized_linear()
    if quantized is None:
        return
    held = {part.source for record in bundle.manifest.layers.values() for part in record.partitions}
    missing = [name for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and name not in held and quantized(name)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise RepackError(f"{missing[0]}{more}: a quantized linear of the model that the bundle does not hold (a model "
                          "with more layers than the bundle's source?); nothing was patched")


def _check_places(model: nn.Module, bundle: Bundle) -> None:
    """Every bundle layer has its model linear(s) of the right shape, and every passthrough tensor the model holds
    has its shape: checked before anything is patched (a model with fewer decoder layers than the bundle's source
    would otherwise be left half-patched)."""
    try:
        for record in bundle.manifest.layers.values():
            for part in record.partitions:
                _model_linear(model, part.source, part.rows[1] - part.rows[0], record.k)
    except RepackError as err:
        raise RepackError(f"{err} (a model with fewer layers than the bundle's source?); nothing was patched") from None
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, record in bundle.manifest.passthrough.items():
        if name in state and list(state[name].shape) != list(record.shape):
            raise RepackError(f"{name}: bundle shape {list(record.shape)} != model shape {list(state[name].shape)}; "
                              "nothing was patched")


def _copy_passthrough(model: nn.Module, bundle: Bundle) -> list[str]:
    """Load the bundle's passthrough tensors into ``model``; the names it has no place for."""
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    unused = []
    with torch.no_grad():
        for name in bundle.manifest.passthrough:
            if name not in state:
                unused.append(name)
                continue
            value = bundle.read(name)
            if state[name].shape != value.shape:
                raise RepackError(f"{name}: bundle shape {list(value.shape)} != model shape {list(state[name].shape)}")
            state[name].copy_(value)
    return unused


def patch_model(model: nn.Module, bundle: str | Path | Bundle | LoadedBundle, device: str | torch.device = "cpu",
                fuse: bool = True) -> list[str]:  # fmt: skip
    """Swap ``model``'s quantized ``nn.Linear`` modules for ``PackedLinear`` and load the passthrough tensors.

    q/k/v_proj and gate/up_proj run as one ``FusedLinear`` each where the bundle holds them fused
    (``convert --fuse``) and, with ``fuse``, where the target's layout stacks unfused layers by copying
    (``Target.stack_rows``: sm90) and they share K and multiplier and have no online transform. Returns the names
    of bundle tensors the model has no place for (e.g. W4A4 activation scales, which weight-only serving does not
    use). A linear of the model that the bundle's quantization config quantizes but the bundle does not hold (a
    model with more layers than the bundle's source), and a bundle layer or tensor the model has no place of that
    shape for (fewer layers) are errors, raised before anything is patched.
    """
    loaded = bundle if isinstance(bundle, LoadedBundle) else load_bundle(bundle, device)
    manifest, target = loaded.bundle.manifest, loaded.bundle.target
    if manifest.tp_size > 1:
        raise RepackError(f"patch_model runs whole models; this bundle is rank {manifest.tp_rank} of --tp {manifest.tp_size}")
    _check_covered(model, loaded.bundle)
    _check_places(model, loaded.bundle)
    unused = _copy_passthrough(model, loaded.bundle)  # first: biases land in the modules they belong to
    done: set[str] = set()
    for name, members in _runtime_fusions(manifest) if fuse and target.stack_rows is not None else []:
        records = [manifest.layers[m] for m in members]
        olds = [_model_linear(model, m, r.n, r.k) for m, r in zip(members, records)]
        stacked = target.stack_rows([loaded.bundle.runtime_layer(m) for m in members], [r.n for r in records],
                                    records[0].k)  # fmt: skip
        if stacked is None:
            continue
        layer = PackedLinear(stacked, sum(r.n for r in records), records[0].k, target.layout_key, loaded.backend,
                             loaded.device, _stacked_bias(olds))  # fmt: skip
        _install_fused(model, name, members, layer, records[0].k)
        done.update(members)
    for prefix, record in manifest.layers.items():
        if prefix in done:
            continue
        members = [p.source for p in record.partitions]
        olds = [_model_linear(model, m, p.rows[1] - p.rows[0], record.k) for m, p in zip(members, record.partitions)]
        layer = loaded.layer(prefix, _stacked_bias(olds), dtype=olds[0].weight.dtype)  # transforms: the model's dtype
        if members == [prefix]:
            _set_module(model, prefix, layer)
        else:  # fused by convert --fuse
            _install_fused(model, prefix, members, layer, record.k)
    return unused
