"""The commands. Each validates its flags, calls one library function and prints the result."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict
from enum import Enum
from inspect import cleandoc
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from ..errors import Interrupted, RepackError
from ..targets import FAMILIES, several_families
from ..targets.engines import (
    DISPLAY_NAMES,
    ENGINES,
    SGLANG_0523,
    SGLANG_DENSE_BACKENDS,
    SGLANG_MOE_LAYOUTS,
    SGLANG_WEIGHT_ONLY_FAMILIES,
    engine_versions,
    resolve_version,
)
from ..targets.families import AUTO, BACKEND_LAYOUTS, LINEAR_BACKENDS, MOE_LAYOUTS

VLLM_VERSIONS = [v.version for v in engine_versions("vllm")]

UNCUT = 1 << 16  # columns: a line written to a pipe or a file is as long as it needs


class _Console(Console):
    """rich's Console for a pipe or a file as for a terminal: rich would cut tables at 80 columns when its stream is
    not a terminal (``targets | grep sm100`` read "flashin…"), so there the lines are as long as they need (``COLUMNS``
    still sets a width); and a reader that went away (``| head``) is the CLI's to report (rich would exit 1)."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self.is_terminal or self._width is not None or "COLUMNS" in os.environ:
            return size
        return ConsoleDimensions(UNCUT, size.height)

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise  # the BrokenPipeError rich caught: run_app ends quietly with the pipe's exit code


stdout = _Console()
stderr = _Console(stderr=True)

TargetOpt = Annotated[
    list[str],
    typer.Option("--target", "-t", metavar="TARGET",
                 help="Target GPU family (see `nvfp4-repack targets`), or a GPU's name (A100, L4, T4, H100, B200, "
                      "\"RTX 4090\"); repeat it, or `all`, for several in one pass."),
]
LinearBackend = Enum("LinearBackend", {name: name for name in (AUTO, *LINEAR_BACKENDS)}, type=str)  # vLLM's names


class Engine(str, Enum):
    """The serving engine whose post-load state a bundle holds."""

    vllm = "vllm"
    sglang = "sglang"


JsonOpt = Annotated[bool, typer.Option("--json", metavar="", help="Print machine-readable JSON to stdout.")]


def printable(text: object, limit: int | None = None) -> str:
    """``text`` with control characters escaped (names from a hostile checkpoint may hold newlines or
    terminal escapes), optionally cut to ``limit`` characters."""
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))
    return out if limit is None or len(out) <= limit else out[: limit - 3] + "..."


def show(text: object) -> str:
    """``text`` safe to embed in rich markup: printable, and brackets that look like tags escaped."""
    return escape(printable(text))


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and its noun, singular for one ("1 transform matrix", "2 transform matrices")."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.2f} TB"


def _flag(help: str, *names: str):
    return typer.Option(*names, metavar="", help=help)


def _model_or_sample(model: str | None, sample: bool, argument: str) -> str:
    """The model a command was given: its ARGUMENT, or the built-in sample's folder for --sample (not both)."""
    from ..sample import SAMPLE_DIR

    if sample == (model is not None):
        raise typer.BadParameter(f"give either {argument} or --sample")
    return str(SAMPLE_DIR) if sample else str(model)


def _default_out(model: Path | str, targets: list[str]) -> Path:
    """``<model>-<target>`` (the first name given), or ``<model>-bundles`` for several target families (a Hub id's
    name part)."""
    name = Path(model).expanduser().resolve().name if Path(model).expanduser().exists() else str(model).rsplit("/")[-1]
    suffix = "bundles" if several_families(targets) else "-".join(targets[0].lower().split())  # "RTX 4090": rtx-4090
    return Path(f"{name}-{suffix}")


def _check_convert_usage(target: list[str], max_shard_size: str, parse_size: Callable[[str], int], *, fuse: bool,
                         tp: int, ep: bool, resume: bool, rescale: bool, weight_only: bool, linear_backend: str,
                         engine: str, vllm: str | None) -> None:
    """The flag values and combinations convert refuses as bad usage (exit code 2), before reading anything: the
    library's own checks (:func:`repack.convert.check_options`), a value's refusal naming its flag."""
    from ..convert import check_options

    for flag, check in (("--target", lambda: several_families(target)), ("--max-shard-size", lambda: parse_size(max_shard_size)),
                        ("--vllm", lambda: resolve_version("vllm", vllm))):
        try:
            check()
        except RepackError as exc:
            raise typer.BadParameter(str(exc), param_hint=f"'{flag}'") from None
    try:
        check_options(target, max_shard_size=max_shard_size, fuse=fuse, tp=tp, ep=ep, resume=resume, rescale=rescale,
                      weight_only=weight_only, linear_backend=linear_backend, engine=engine, vllm=vllm)
    except RepackError as exc:
        raise typer.BadParameter(str(exc)) from None


def _check_out(out: str, source: str) -> Path:
    """``-o``'s folder, refused as bad usage (exit code 2) where it is empty (it would mean the current folder) or a
    local source's own folder, or lies inside it."""
    from ..bundle.writer import clash_with_input

    if not out.strip():
        raise typer.BadParameter("an empty path; name the output folder",
                                 param_hint="'--out'")
    clash = clash_with_input(Path(out), Path(source)) if Path(source).expanduser().exists() else None
    if clash:
        raise typer.BadParameter(clash, param_hint="'--out'")
    return Path(out)


def convert(
    target: TargetOpt,
    model: Annotated[
        Optional[str], typer.Argument(help="Source model: a folder (config.json + .safetensors) or a Hub repo id.")
    ] = None,
    out: Annotated[
        Optional[str],
        typer.Option("--out", "-o", metavar="<path>", help="Output bundle folder (default: <model>-<target>); with several targets, "
                                         "the folder that receives one <target> bundle each (default: <model>-bundles)."),
    ] = None,
    revision: Annotated[
        Optional[str], typer.Option(help="Hub branch, tag or commit of a repo-id MODEL (default: its main branch).")
    ] = None,
    overwrite: Annotated[bool, _flag("Replace an existing bundle at OUT.", "--overwrite")] = False,
    resume: Annotated[
        bool, _flag("Continue an interrupted convert: keep the finished shards it left, write the rest.", "--resume")
    ] = False,
    no_fsync: Annotated[bool, _flag(
        "Publish without waiting for the disk (faster where it is slow; for CI jobs that rerun a failed step): "
        "a kill still leaves OUT whole or absent, a machine crash may leave data unwritten.", "--no-fsync")] = False,
    max_shard_size: Annotated[
        str, typer.Option(help="Largest output shard, with a unit: 5GB, 500MB (powers of 1000), 4GiB (of 1024).")
    ] = "5GB",
    sample: Annotated[bool, _flag("Convert the built-in tiny sample checkpoint.", "--sample")] = False,
    fuse: Annotated[bool, _flag("Write vLLM's fused qkv_proj / gate_up_proj modules (one target).", "--fuse")] = False,
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel ranks: OUT/rank-0 ... (implies --fuse).")] = 1,
    ep: Annotated[bool, _flag(
        "MoE models: place whole experts on the --tp N ranks (N > 1), as vLLM's --enable-expert-parallel (SGLang's "
        "--ep-size N) does, instead of splitting every expert's intermediate size.", "--ep")] = False,
    rescale: Annotated[bool, _flag(
        "Fold unequal partition global scales into the block scales instead of refusing.", "--rescale")] = False,
    weight_only: Annotated[bool, _flag(
        "Serve a W4A4 checkpoint weight-only (bf16 activations), with the family's weight-only kernel: Marlin on "
        "sm120 (vLLM's --linear-backend marlin), the W4A16 layout on sm100. By default a W4A4 checkpoint gets the W4A4 "
        "layout vLLM's auto serves it with on sm100/sm120 (sm90 is always weight-only). With --engine sglang: "
        "SGLang's FP4 Marlin state (serve with --fp4-gemm-backend marlin).",
        "--weight-only")] = False,
    linear_backend: Annotated[LinearBackend, typer.Option(
        "--linear-backend", help="The layout of the kernel vLLM picks with this --linear-backend (serve the bundle "
                                 "with the same flag): e.g. flashinfer_cutedsl on sm120 for FlashInfer's cute-dsl "
                                 "W4A16 kernel; default auto, vLLM's own choice.")] = LinearBackend.auto,
    engine: Annotated[Engine, typer.Option(
        "--engine", case_sensitive=False, help="The serving engine whose post-load state the bundle holds: vllm, or sglang (SGLang 0.5.23: "
                         "dense and MoE checkpoints, its fused modules under its names, for one target; what is "
                         "written for which GPU and backend: docs/sglang.md).")] = Engine.vllm,
    vllm: Annotated[Optional[str], typer.Option(
        "--vllm", metavar="VERSION", help=f"The vLLM version the bundle is for ({', '.join(VLLM_VERSIONS)}; default: the "
        "newest). The manifest lists every version whose state the bundle is; one the version cannot serve is "
        "refused.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Convert an NVFP4 checkpoint into runtime-layout bundles: one target, or several in one pass.

    Examples:
      nvfp4-repack convert --sample --target sm100 -o sample-sm100
      nvfp4-repack convert ./Llama-3.1-8B-NVFP4 --target sm120 -o llama-sm120
      nvfp4-repack convert ./Llama-3.1-8B-NVFP4 --target sm100 --tp 2 -o llama-sm100-tp2
      nvfp4-repack convert ./Qwen3-30B-A3B-NVFP4 --target sm100 --tp 4 --ep -o qwen3-moe-sm100-ep4
      nvfp4-repack convert nvidia/Llama-3.1-8B-Instruct-FP4 -t sm100 -t sm120 -t sm90 -o llama  # llama/sm100, ...
      nvfp4-repack convert ./Llama-3.1-8B-NVFP4 --target "RTX 4090" -o llama-4090  # a GPU's name: sm80 (Marlin)
      nvfp4-repack convert ./Llama-3.1-8B-NVFP4 --target sm100 --engine sglang -o llama-sglang-sm100
    """
    from ..bundle.plan import parse_size
    from ..convert import convert as run_convert

    source = _model_or_sample(model, sample, "MODEL")
    _check_convert_usage(target, max_shard_size, parse_size, fuse=fuse, tp=tp, ep=ep, resume=resume, rescale=rescale,
                         weight_only=weight_only, linear_backend=linear_backend.value, engine=engine.value, vllm=vllm)
    destination = _check_out(out, source) if out is not None else _default_out(source, target)
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        TimeRemainingColumn(), console=stderr, transient=True, disable=as_json or not stderr.is_terminal,
    )
    task = progress.add_task("converting", total=None)
    started = []

    def start_bar(src: object, outputs: list) -> None:
        progress.update(task, total=sum(u.nbytes for u in src.checkpoint.tensors.values()))  # type: ignore[attr-defined]
        progress.start()
        started.append(True)

    try:
        result = run_convert(
            source, target[0] if len(target) == 1 else target, destination, revision=revision, overwrite=overwrite,
            resume=resume, fsync=not no_fsync, max_shard_size=max_shard_size, fuse=fuse, tp=tp, rescale=rescale,
            weight_only=weight_only, ep=ep, vllm=vllm, engine=engine.value, linear_backend=linear_backend.value,
            on_plan=start_bar,
            notify=lambda line: stderr.print(show(line), soft_wrap=True, highlight=False),
            progress=lambda nbytes, what: progress.update(task, advance=nbytes, description=show(what[-48:])),
        )
    finally:
        if started:  # stopping a bar never started prints a stray blank line (rich 15)
            progress.stop()
    summaries = result if isinstance(result, list) else [result]
    if as_json:  # one shape for one target or several: a list, a summary per target family
        print(json.dumps([{**asdict(s), "out": str(s.out)} for s in summaries], indent=2))
        return
    for summary in summaries:
        for prefix, error in summary.rescaled.items():
            stdout.print(f"rescaled {show(prefix)}: unequal global scales folded into block scales, "
                         f"added relative L2 weight error {error:.3g}", highlight=False)
        ranks = f" ({count(len(summary.bundles), 'tensor-parallel rank')})" if len(summary.bundles) > 1 else ""
        kept = f", {count(summary.kept_shards, 'shard')} kept from the interrupted run" if summary.kept_shards else ""
        table = Table(title=f"bundle for {summary.target} written to {show(summary.out)}{ranks}{kept}")
        moe = ("FusedMoE layers",) if summary.moe_layers else ()
        for column in ("quantized layers", *moe, "passthrough tensors", "bytes in", "bytes out", "time"):
            table.add_column(column, justify="right")
        table.add_row(str(summary.layers), *[str(summary.moe_layers)] * bool(moe), str(summary.passthrough),
                      _human(summary.bytes_in), _human(summary.bytes_out), f"{summary.seconds:.2f} s")
        stdout.print(table)


def _inspect_bundle(path: Path) -> None:
    from ..bundle.reader import open_bundle

    bundle = open_bundle(path)
    manifest = bundle.manifest
    stdout.print(f"[bold]bundle[/] {show(path)}  target [bold]{show(manifest.target)}[/] "
                 f"({show(manifest.layout_id)}; {show(bundle.target.description)}), "
                 f"format v{manifest.bundle_format_version}, tool {show(manifest.tool_version)}")
    stdout.print(f"source: {show(manifest.source.format)} {show(manifest.source.quant_algo)} "
                 f"from {show(manifest.source.path)}")
    if manifest.flashinfer_versions:  # a FlashInfer layout's (Marlin's and sm90's run no FlashInfer code at load)
        stdout.print(f"FlashInfer versions checked: {show(', '.join(manifest.flashinfer_versions))}")
    engine = DISPLAY_NAMES[bundle.target.engine]  # whose kernels (SGLang: its FP4 GEMM backend) the manifest names
    stdout.print(f"scheme {show(manifest.scheme)}; {engine} kernels: {show(', '.join(manifest.kernels) or 'unrecorded')}")
    stdout.print("serves: " + show("; ".join(f"{engine} {', '.join(versions) or 'none'}"
                                             for engine, versions in manifest.engines.items())))
    stdout.print(f"tensor parallel: rank {manifest.tp_rank} of {manifest.tp_size}; fusion: "
                 + (show(", ".join(f"{k} = {' + '.join(v)}" for k, v in manifest.fusion.items())) or "none"))
    table = Table(title=f"{count(len(manifest.layers), 'quantized layer')}, "
                        f"{count(len(manifest.passthrough), 'passthrough tensor')}")
    sliced = bool(manifest.fusion) or manifest.tp_size > 1  # otherwise every layer is its whole source layer
    columns = ("layer", "N x K", "padded", "K pad (bytes)", "global scale") + (("source rows x cols",) * sliced)
    for column in columns + (("online transforms",) if manifest.transforms else ()):
        table.add_column(column)
    for prefix, layer in manifest.layers.items():
        origin = "; ".join(f"{p.source.rsplit('.', 1)[-1]} {p.source_rows[0]}:{p.source_rows[1]} x "
                           f"{p.source_cols[0]}:{p.source_cols[1]}" + (f" (x{p.scale_ratio:.4g})" if p.scale_ratio != 1 else "")
                           for p in layer.partitions)
        transforms = ", ".join(f"{t.location}: {manifest.transforms[t.matrix].scheme} "
                               f"{manifest.transforms[t.matrix].type} b={t.block_size}"
                               + (f" (partitions {t.partitions})" if t.partitions is not None else "")
                               for t in layer.transforms)
        transforms += "; vLLM runs QuTLASS" if bundle.runs_qutlass(prefix) else ""
        table.add_row(show(prefix), f"{layer.n} x {layer.k}", " x ".join(map(str, layer.padded_shape)),
                      str(layer.weights_padding_cols), f"{layer.global_scale:.6g}", *([show(origin)] * sliced),
                      *([show(transforms or "-")] if manifest.transforms else []))
    stdout.print(table)
    if manifest.moe:
        stdout.print(_moe_table(manifest, engine))
    if manifest.transforms:
        stdout.print(f"{count(len(manifest.transforms), 'online-transform matrix', 'online-transform matrices')}, "
                     f"each stored once: "
                     + ", ".join(f"{show(name)} ({rec.tensor.dtype} [{rec.block_size}]^2, /{rec.scale:g})"
                                 for name, rec in manifest.transforms.items()), soft_wrap=True)


def _moe_table(manifest, engine: str) -> Table:
    """A bundle's FusedMoE layers: the engine's module, the experts it holds, top-k, sizes, layout and the engine's MoE
    backend."""
    first = next(iter(manifest.moe.values()))
    table = Table(title=f"{count(len(manifest.moe), 'FusedMoE layer')}, layout {show(first.layout_id)} ({engine} backend "
                        f"{show(first.backend)}, {show(' or '.join(first.kernels))})")
    for column in ("module", "experts held", "top-k", "hidden", "intermediate (rows)", "input scale of"):
        table.add_column(column)
    for module, record in manifest.moe.items():
        placement = " (expert parallel)" if record.expert_map is not None else ""
        table.add_row(show(module), f"{record.experts[0]}:{record.experts[1]} of {record.num_experts}{placement}",
                      str(record.top_k or "-"), str(record.hidden),
                      f"{record.intermediate} ({record.rows[0]}:{record.rows[1]})", f"{record.input_scales} experts")
    return table


def _transform_summary(source) -> list[dict]:
    """Online transforms grouped by scheme, type, location and block size, with the layers each covers."""
    groups: dict[tuple[str, str, str, int], list[str]] = {}
    for prefix, transforms in source.transforms.layers.items():
        for t in transforms:
            groups.setdefault((t.matrix.scheme, t.matrix.type, t.location, t.matrix.size), []).append(prefix)
    return [{"scheme": s, "type": kind, "location": loc, "block_size": b, "layers": layers}
            for (s, kind, loc, b), layers in sorted(groups.items())]


def _inspect_source(model: str, revision: str | None, as_json: bool) -> None:
    from ..convert import vllm_versions
    from ..formats import read_source

    source = read_source(model, revision=revision)
    origin = source.checkpoint.origin
    path = f"{origin.repo_id}@{origin.commit}" if origin.repo_id else model
    shapes: dict[tuple[int, int], int] = {}
    for layer in source.layers.values():
        shapes[(layer.n, layer.k)] = shapes.get((layer.n, layer.k), 0) + 1
    activation = _activation_scales(source)
    info = {
        "path": path,
        "format": source.format,
        "quant_algo": source.quant_algo,
        "quantized_layers": len(source.layers),
        "passthrough_tensors": len(source.passthrough) - len(activation),
        "activation_scales": len(activation),
        "layer_shapes": [{"n": n, "k": k, "count": c} for (n, k), c in sorted(shapes.items())],
        "transforms": _transform_summary(source),
        "moe": _moe_summary(source),
    }
    # the families convert writes this source for (an MoE one: those with an MoE layout, with --fuse / --tp), and per
    # family the vLLM versions its default bundle serves (a rotated checkpoint's may be one: convert refuses the other)
    info["targets"] = [t.name for t in FAMILIES if info["moe"] is None or (info["moe"].get("layouts") or {}).get(t.name)]
    info["vllm_versions"] = {name: vllm_versions(source, name) for name in info["targets"]}
    if as_json:
        print(json.dumps(info, indent=2))
        return
    stdout.print(f"[bold]{show(source.format)}[/] {show(source.quant_algo)} checkpoint at {show(path)}")
    folded = (f", {count(len(activation), 'activation input scale')} (the W4A4 layouts fold them in; "
              "--weight-only and sm90 copy them)") if activation else ""
    stdout.print(f"{count(len(source.layers), 'quantized layer')}, {count(info['passthrough_tensors'], 'passthrough tensor')} "
                 f"(copied as they are){folded}", soft_wrap=True, highlight=False)
    table = Table(title="quantized layers by shape")
    for column in ("N (out)", "K (in)", "layers"):
        table.add_column(column, justify="right")
    for (n, k), layers in sorted(shapes.items()):
        table.add_row(str(n), str(k), str(layers))
    stdout.print(table)
    if info["transforms"]:
        table = Table(title="online transforms (weight_input / weight_output ones are already in the weights)")
        for column in ("scheme", "type", "location", "block size", "layers"):
            table.add_column(column)
        for row in info["transforms"]:
            table.add_row(show(row["scheme"]), row["type"], row["location"], str(row["block_size"]),
                          str(len(row["layers"])))
        stdout.print(table)
    if info["moe"] and "unsupported" in info["moe"]:
        stdout.print(f"MoE: not supported: {show(info['moe']['unsupported'])}")
    elif info["moe"]:
        moe = info["moe"]
        layouts = ", ".join(f"{family} {layout or 'not supported'}" for family, layout in moe["layouts"].items())
        stdout.print(f"MoE: {moe['fused_moe_layers']} FusedMoE layers of {'/'.join(map(str, moe['experts']))} "
                     f"experts (top-{moe['top_k']}), hidden {moe['hidden']}, intermediate "
                     f"{'/'.join(map(str, moe['intermediate']))}, {moe['shared_expert_modules']} shared-expert "
                     f"modules; vLLM's MoE layouts: {layouts} (convert --fuse / --tp writes them: docs/moe.md)")
    moe = " (with --fuse or --tp N)" if info["moe"] and info["targets"] else ""
    every = [v.version for v in engine_versions("vllm")]
    named = [name + ("" if not versions or versions == every else f" (vLLM {', '.join(versions)} only"
                     + ("" if versions[-1] == every[-1] else f": convert --vllm {versions[-1]}") + ")")
             for name, versions in info["vllm_versions"].items()]
    stdout.print(f"possible targets: {', '.join(named) or 'none'}{moe}", highlight=False)


def _activation_scales(source) -> list[str]:
    """A W4A4 checkpoint's activation input scales, one per quantized layer: among the source's other tensors, but
    a W4A4 bundle folds them into its layers (convert's count of passthrough tensors leaves them out)."""
    if source.activation_scheme != "W4A4":
        return []
    names = {source.input_scale_name(prefix) for prefix in source.layers}
    return [name for name in source.passthrough if name in names]


def _moe_summary(source) -> dict | None:
    """formats' MoE summary plus the layout each target family's vLLM ``auto`` uses for it (``None``: refused)."""
    from ..errors import RepackError
    from ..formats.moe import moe_summary
    from ..targets.moe import moe_layout

    summary = moe_summary(source)
    if summary is None or "unsupported" in summary:
        return summary
    layouts = {}
    for family in FAMILIES:
        try:
            layouts[family.name] = moe_layout(family.name, source.activation_scheme).LAYOUT_ID
        except RepackError:
            layouts[family.name] = None
    return {**summary, "layouts": layouts}


def inspect(
    path: Annotated[
        Optional[str], typer.Argument(help="A bundle folder, or a source model: a folder or a Hub repo id.")
    ] = None,
    revision: Annotated[
        Optional[str], typer.Option(help="Hub branch, tag or commit of a repo-id PATH (default: its main branch).")
    ] = None,
    sample: Annotated[bool, _flag("Describe the built-in tiny sample checkpoint.", "--sample")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Describe a source checkpoint (format, layers, shapes) or a bundle (its manifest).

    An output folder of several targets, or of --tp ranks: each of its bundles.

    Examples:
      nvfp4-repack inspect ./Llama-3.1-8B-NVFP4
      nvfp4-repack inspect nvidia/Llama-3.1-8B-Instruct-FP4
      nvfp4-repack inspect --sample
      nvfp4-repack inspect sample-sm100 --json
    """
    from ..bundle.reader import is_bundle
    from ..verify import member_bundles

    model = _model_or_sample(path, sample, "PATH")
    local = Path(model).expanduser()
    if revision is not None or not local.exists():  # a Hub repo id, resolved as convert and verify do
        _inspect_source(model, revision, as_json)
        return
    members = member_bundles(local) if local.is_dir() else [local]
    if members == [local] and not is_bundle(local):
        _inspect_source(model, None, as_json)
    elif as_json:  # one shape for one bundle or several (targets, ranks): a list of their manifests
        from ..bundle.reader import open_bundle

        print(json.dumps([json.loads(open_bundle(member).manifest.to_json()) for member in members], indent=2))
    else:
        for member in members:
            _inspect_bundle(member)


def targets(as_json: JsonOpt = False) -> None:
    """List the target GPU families, their aliases, GPUs, runtime backends and layouts.

    A W4A4 checkpoint converts into the family's W4A4 layout (sm100, sm120: the layout vLLM's FP4 x FP4 kernels
    share), a weight-only one into its W4A16 layout (sm120: Marlin's, vLLM's auto there); sm90 (no FP4 tensor cores)
    is weight-only for every checkpoint, and so are sm80 and sm75 (Marlin: A100 .. L40S, T4; a W4A4 checkpoint keeps
    its activation scalars unused). MoE layers (convert --fuse / --tp N) take the family's MoE layout for the
    checkpoint's scheme (weight-only experts: Marlin's on sm80, sm100 and sm120; sm75: fp16 Marlin's); sm90 refuses MoE
    (convert for sm80: vLLM serves Marlin on Hopper with --moe-backend marlin). --target also takes a GPU's name.
    "served by" names the engine versions whose post-load state each family's bundles are (SGLang's: convert --engine
    sglang, docs/sglang.md).
    """
    rows = [
        {
            "name": t.name,
            "aliases": list(t.aliases),
            "compute_capabilities": [f"{major}.{minor}" for major, minor in t.compute_capabilities],
            "backend": t.backend,
            "layout_id": t.layout_id,
            "layouts": {scheme: {"layout_id": layout_id, "kernels": list(kernels), "engines": _holding(layout_id)}
                        for scheme, (layout_id, kernels) in t.scheme_layouts.items()},
            "moe_layouts": MOE_LAYOUTS.get(t.name, {}),
            "sglang": _sglang_support(t.name),
            "description": t.description,
        }
        for t in FAMILIES
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    cells = [_target_cells(row) for row in rows]
    table = Table(title="targets")
    for column in TARGET_COLUMNS:
        table.add_column(column)
    for row in cells:
        table.add_row(*row.values())
    if stdout.measure(table, options=stdout.options.update_width(UNCUT)).maximum <= stdout.width:
        stdout.print(table)
    else:  # narrower than the table (a terminal of 80 or 120 columns): one block per target, nothing cut
        for row in cells:
            stdout.print(f"[bold]{row['target']}[/]: {row['GPUs']}; SM {row['SM']}; aliases {row['aliases']}",
                         highlight=False)
            for column in TARGET_COLUMNS[3:-1]:
                stdout.print(f"  {column}: {row[column]}", highlight=False)
    stdout.print("--target also takes a GPU name, as nvidia-smi prints it or short: A100, L40S, RTX 4090, T4, H100, "
                 "B200, RTX 5090, ...", highlight=False)
    for row in rows:  # the kernel classes vLLM runs on each layout (the W4A4 layout's: its auto's first)
        kernels = "; ".join(f"{scheme} {', '.join(layout['kernels'])}" for scheme, layout in row["layouts"].items())
        stdout.print(f"{row['name']} vLLM kernels: {kernels}", highlight=False)
    for family, backend, scheme, layout_id in BACKEND_LAYOUTS:
        stdout.print(f"{family} --linear-backend {backend} ({scheme} checkpoints): {layout_id}", highlight=False)
    for version in ENGINES:  # what a version holds differently from a bundle: convert refuses it for that version
        for feature, why in version.refuses.items():
            stdout.print(f"{version.label} ({version.release} checked) refuses {feature}: {why}", highlight=False)


TARGET_COLUMNS = ("target", "aliases", "SM", "runtime backend", "W4A16 layout", "W4A4 layout", "MoE layout", "served by",
                  "GPUs")


def _target_cells(row: dict) -> dict[str, str]:
    """One family's ``targets`` row as text, by column."""
    w4a4 = row["layouts"].get("W4A4", {}).get("layout_id", "none: weight-only")
    served = {f"{engine} {', '.join(versions)}" for layout in row["layouts"].values()
              for engine, versions in layout["engines"].items()}
    if row["sglang"]:  # with --engine sglang (docs/sglang.md)
        served.add(f"sglang {row['sglang']['version']} ({row['sglang']['serves']}, --engine sglang)")
    moe = "; ".join(f"{scheme} {layout}" for scheme, layout in row["moe_layouts"].items()) or "none"
    return dict(zip(TARGET_COLUMNS, (row["name"], ", ".join(row["aliases"]), ", ".join(row["compute_capabilities"]),
                                     row["backend"], row["layout_id"], w4a4, moe, "; ".join(sorted(served)),
                                     row["description"])))


def _sglang_support(family: str) -> dict[str, str] | None:
    """What ``convert --engine sglang`` writes for ``family``: SGLang's version, the dense schemes and the MoE kernels
    (None: nothing, sm75; the architectures and checkpoints: docs/sglang.md)."""
    if family not in SGLANG_WEIGHT_ONLY_FAMILIES:
        return None
    dense = "W4A4, W4A16" if family in SGLANG_DENSE_BACKENDS else "weight-only: Marlin"
    moe = ("FlashInfer (W4A4), FP4 Marlin (compressed-tensors weight-only)"
           if any(f == family for _, f in SGLANG_MOE_LAYOUTS) else "FP4 Marlin")
    return {"version": SGLANG_0523.version, "serves": f"{dense}; MoE: {moe}"}


def _holding(layout_id: str) -> dict[str, list[str]]:
    """Per engine, the versions that hold layout ``layout_id`` as the bundle stores it."""
    out: dict[str, list[str]] = {}
    for version in ENGINES:
        if layout_id in version.layouts:
            out.setdefault(version.engine, []).append(version.version)
    return out


class DeviceChoice(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class NumericsChoice(str, Enum):
    auto = "auto"
    all = "all"
    sample = "sample"


FAILURES_SHOWN = 5  # per check kind; the rest are counted (all of them are in --json / --report)


def verify(
    bundle: Annotated[
        Path, typer.Argument(help="The bundle folder to check, or a convert output of several targets or --tp ranks.")
    ],
    source: Annotated[
        Optional[str],
        typer.Option(help="The source checkpoint, a folder or Hub repo id (default: the folder recorded in the "
                          "manifest, if it exists)."),
    ] = None,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision of a repo-id --source.")] = None,
    no_source: Annotated[
        bool, _flag("Check integrity and numerics only, when the source is not at hand.", "--no-source")
    ] = False,
    device: Annotated[DeviceChoice, typer.Option(help="Where the runtime GEMM runs.")] = DeviceChoice.cpu,
    numerics: Annotated[
        NumericsChoice,
        typer.Option(help="Layers whose numerics run: all (every expert of every MoE layer too), or a sample "
                          "(each layer shape once and one more; per MoE layer shape the first expert, one more and "
                          "any whose scalars stand out); auto: all on a GPU, a sample on the CPU, experts sampled. "
                          "Exactness always covers every layer and expert."),
    ] = NumericsChoice.auto,
    as_json: JsonOpt = False,
    report_file: Annotated[
        Optional[Path], typer.Option("--report", help="Also write the JSON report to this file.")
    ] = None,
    seed: Annotated[Optional[int], typer.Option(
        help="Seed for the random activations and the sample (default: derived from the manifest, the same every run)."
    )] = None,
) -> int:
    """Prove a bundle computes the same function as its source: integrity, exactness, numerics.

    An output folder of several targets: every target's bundle, the source hashed once. A --tp output
    folder: every rank, and each source layer reassembled from the ranks' outputs.
    Exits 0 only when every check passes. The source must be the checkpoint the bundle was built from (by
    its files' digests); without one, verify fails unless --no-source is given.

    Examples:
      nvfp4-repack verify sample-sm100
      nvfp4-repack verify llama-sm90 --source ./Llama-3.1-8B-NVFP4 --device cuda --report report.json
      nvfp4-repack verify llama-sm100 --no-source --json
      nvfp4-repack verify llama-bundles  # the output of convert -t all -o llama-bundles
    """
    from ..bundle.reader import open_bundle
    from ..verify import member_bundles, resolve_source, verify_output

    if no_source and source is not None:
        raise typer.BadParameter("give either --source or --no-source")
    opened = [open_bundle(b) for b in member_bundles(bundle)]
    src = None if no_source else resolve_source(opened[0], source, revision)
    if src is None and not no_source:
        raise RepackError(f"{opened[0].manifest.source.path}: the bundle's source is not there; pass --source MODEL, "
                          "or --no-source to check integrity and numerics only")
    total = sum(len(b.manifest.layers) + len(b.manifest.passthrough) for b in opened)
    with Progress(TextColumn("[bold]verifying"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.description}"), console=stderr, transient=True,
                  disable=as_json or not stderr.is_terminal) as progress:
        task = progress.add_task("", total=total)
        report = verify_output(
            bundle, source=src, no_source=no_source, device=device.value, seed=seed, numerics=numerics.value,
            progress=lambda name: progress.update(task, advance=1, description=show(name[-48:])),
        )
    data = report.to_dict()
    if report_file is not None:
        report_file.write_text(json.dumps(data, indent=2) + "\n")
    if as_json:
        print(json.dumps(data, indent=2))
        return 0 if report.passed else 1
    _print_verify(bundle, report)
    return 0 if report.passed else 1


def _print_verify(bundle: Path, report) -> None:
    table = Table(title=f"{show(bundle)} ({report.target}, {report.backend} backend on {report.device}; "
                        f"source: {show(report.source or 'not checked (--no-source), numerics use the bundle decode')})")
    for column in ("layer", "status", "max rel. error", "problems"):
        table.add_column(column)
    for check in report.layers:
        error = f"{check.max_rel_error:.2e}" if check.max_rel_error is not None else "-"
        style = {"ok": "green", "skipped": "yellow"}.get(check.status, "red")
        table.add_row(show(check.name), f"[{style}]{check.status}[/]", error, str(len(check.errors) or ""))
    stdout.print(table)
    departures = [c.rescale_error for c in report.layers if c.rescale_error is not None]
    if departures:
        stdout.print(f"{count(len(departures), 'layer')} rescaled by --rescale: numerics against their rescaled weights, which "
                     f"depart from the unfused source by up to {max(departures):.3g} (relative L2), each bounded by "
                     "the error convert recorded", soft_wrap=True, highlight=False)
    experts = f" and {report.numerics_experts} of {count(report.experts, 'expert')}" if report.experts else ""
    if report.passed:
        scope = ("integrity, exactness against the source, numerics" if report.source else
                 "integrity and numerics against the bundle's own decode; exactness was NOT checked (--no-source)")
        matrices = f", {count(len(report.transforms), 'transform matrix', 'transform matrices')}" if report.transforms else ""
        stdout.print(f"[green]PASS[/]: {count(len(report.layers), 'layer')}, "
                     f"{count(len(report.passthrough), 'passthrough tensor')}{matrices}, {count(len(report.files), 'file')}; "
                     f"numerics on {report.numerics_layers} of {count(len(report.layers), 'layer')}{experts}, "
                     f"relative error <= {report.tolerance:g} ({scope}; activation seed {report.seed})", soft_wrap=True)
        return
    summary = report.summary()
    for kind, messages in summary.items():
        stdout.print(f"[red]FAIL[/] {kind}: {count(len(messages), 'problem')}", highlight=False)
        for message in messages[:FAILURES_SHOWN]:
            stdout.print(f"  {show(message)}", soft_wrap=True, highlight=False)
        if len(messages) > FAILURES_SHOWN:
            stdout.print(f"  ... and {len(messages) - FAILURES_SHOWN} more (all of them: --report FILE)", highlight=False)
    counts = ", ".join(f"{kind} {len(messages)}" for kind, messages in summary.items())
    stdout.print(f"[red]FAIL[/]: {counts} (activation seed {report.seed}; numerics on {report.numerics_layers} of "
                 f"{count(len(report.layers), 'layer')}{experts})", soft_wrap=True, highlight=False)


def _interruptible(command: Callable) -> Callable:
    """Ctrl-C as :class:`Interrupted`, which reaches the CLI's handler (Typer would exit 130 without a word)."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt:
            raise Interrupted() from None

    return run


def flowed(doc: str) -> str:
    """A command's docstring as its --help text: each prose paragraph on one line, for rich to wrap at the terminal's
    width (Typer keeps a docstring's line breaks, which break sentences mid-line), indented lines (examples) as
    written."""
    paragraphs = cleandoc(doc).split("\n\n")
    return "\n\n".join(p if any(line[:1].isspace() for line in p.splitlines()) else " ".join(p.split("\n"))
                       for p in paragraphs)


def register(app: typer.Typer) -> None:
    for command in (convert, inspect, targets, verify):
        app.command(help=flowed(command.__doc__ or ""))(_interruptible(command))
