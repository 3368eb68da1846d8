"""The commands. Each validates its flags, calls one library function and prints the result."""

from __future__ import annotations

import json
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from ..bundle.plan import BundlePlan
from ..errors import RepackError
from ..targets import TARGETS

stdout = Console()
stderr = Console(stderr=True)

TargetOpt = Annotated[str, typer.Option("--target", "-t", help="Target GPU family: see `nvfp4-repack targets`.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON to stdout.")]


def printable(text: object, limit: int | None = None) -> str:
    """``text`` with control characters escaped (names from a hostile checkpoint may hold newlines or
    terminal escapes), optionally cut to ``limit`` characters."""
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))
    return out if limit is None or len(out) <= limit else out[: limit - 3] + "..."


def show(text: object) -> str:
    """``text`` safe to embed in rich markup: printable, and brackets that look like tags escaped."""
    return escape(printable(text))


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.2f} TB"


def convert(
    target: TargetOpt,
    model: Annotated[Optional[Path], typer.Argument(help="Source model folder (config.json + .safetensors).")] = None,
    out: Annotated[
        Optional[Path], typer.Option("--out", "-o", help="Output bundle folder (default: <model>-<target>).")
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
    max_shard_size: Annotated[str, typer.Option(help="Largest output shard, e.g. 5GB or 500MB.")] = "5GB",
    sample: Annotated[bool, typer.Option("--sample", help="Convert the built-in tiny sample checkpoint.")] = False,
    fuse: Annotated[bool, typer.Option("--fuse", help="Write vLLM's fused qkv_proj / gate_up_proj modules.")] = False,
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel ranks: OUT/rank-0 ... (implies --fuse).")] = 1,
    rescale: Annotated[bool, typer.Option(
        "--rescale", help="Fold unequal partition global scales into the block scales instead of refusing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Convert an NVFP4 checkpoint into a runtime-layout bundle for one target.

    Examples:
      nvfp4-repack convert --sample --target sm100 -o sample-sm100
      nvfp4-repack convert ./Llama-3.1-8B-NVFP4 --target sm120 -o llama-sm120
      nvfp4-repack convert ./Llama-3.1-8B-NVFP4 --target sm100 --tp 2 -o llama-sm100-tp2
    """
    from ..convert import convert as run_convert
    from ..sample import SAMPLE_DIR

    if sample == (model is not None):
        raise typer.BadParameter("give either MODEL or --sample")
    source = SAMPLE_DIR if sample else model
    assert source is not None
    destination = out or Path(f"{source.resolve().name}-{target.lower()}")
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        TimeRemainingColumn(), console=stderr, transient=True, disable=as_json or not stderr.is_terminal,
    )
    task = progress.add_task("converting", total=None)
    started = []

    def start_bar(src: object, plans: list[BundlePlan]) -> None:
        progress.update(task, total=sum(plan.total_bytes for plan in plans))
        progress.start()
        started.append(True)

    try:
        summary = run_convert(
            source, target, destination, overwrite=overwrite, max_shard_size=max_shard_size, fuse=fuse, tp=tp,
            rescale=rescale, on_plan=start_bar,
            progress=lambda nbytes, what: progress.update(task, advance=nbytes, description=show(what[-48:])),
        )
    finally:
        if started:  # stopping a bar never started prints a stray blank line (rich 15)
            progress.stop()
    if as_json:
        print(json.dumps({**asdict(summary), "out": str(summary.out)}, indent=2))
        return
    for prefix, error in summary.rescaled.items():
        stdout.print(f"rescaled {show(prefix)}: partition scales folded into block scales, "
                     f"added relative L2 weight error {error:.3g}", highlight=False)
    ranks = f" ({len(summary.bundles)} tensor-parallel ranks)" if len(summary.bundles) > 1 else ""
    table = Table(title=f"bundle for {summary.target} written to {show(summary.out)}{ranks}")
    for column in ("quantized layers", "passthrough tensors", "bytes in", "bytes out", "time"):
        table.add_column(column, justify="right")
    table.add_row(str(summary.layers), str(summary.passthrough), _human(summary.bytes_in),
                  _human(summary.bytes_out), f"{summary.seconds:.2f} s")
    stdout.print(table)


def _inspect_bundle(path: Path, as_json: bool) -> None:
    from ..bundle.reader import open_bundle

    bundle = open_bundle(path)
    manifest = bundle.manifest
    if as_json:
        print(manifest.to_json(), end="")
        return
    stdout.print(f"[bold]bundle[/] {show(path)}  target [bold]{show(manifest.target)}[/] "
                 f"({show(manifest.layout_id)}), format v{manifest.bundle_format_version}, "
                 f"tool {show(manifest.tool_version)}")
    stdout.print(f"source: {show(manifest.source.format)} {show(manifest.source.quant_algo)} "
                 f"from {show(manifest.source.path)}")
    stdout.print(f"FlashInfer versions checked: {show(', '.join(manifest.flashinfer_versions))}")
    stdout.print(f"tensor parallel: rank {manifest.tp_rank} of {manifest.tp_size}; fusion: "
                 + (show(", ".join(f"{k} = {' + '.join(v)}" for k, v in manifest.fusion.items())) or "none"))
    table = Table(title=f"{len(manifest.layers)} quantized layers, {len(manifest.passthrough)} passthrough tensors")
    sliced = bool(manifest.fusion) or manifest.tp_size > 1  # otherwise every layer is its whole source layer
    columns = ("layer", "N x K", "padded", "K pad (bytes)", "global scale") + (("source rows x cols",) * sliced)
    for column in columns + (("online transforms",) if manifest.transforms else ()):
        table.add_column(column)
    for prefix, layer in manifest.layers.items():
        origin = "; ".join(f"{p.source.rsplit('.', 1)[-1]} {p.source_rows[0]}:{p.source_rows[1]} x "
                           f"{p.source_cols[0]}:{p.source_cols[1]}" + (f" (x{p.scale_ratio:.4g})" if p.scale_ratio != 1 else "")
                           for p in layer.partitions)
        transforms = ", ".join(f"{t.location}: {manifest.transforms[t.matrix].scheme} "
                               f"{manifest.transforms[t.matrix].type} b={t.block_size}" for t in layer.transforms)
        table.add_row(show(prefix), f"{layer.n} x {layer.k}", " x ".join(map(str, layer.padded_shape)),
                      str(layer.weights_padding_cols), f"{layer.global_scale:.6g}", *([show(origin)] * sliced),
                      *([show(transforms or "-")] if manifest.transforms else []))
    stdout.print(table)
    if manifest.transforms:
        stdout.print(f"{len(manifest.transforms)} online-transform matrices, each stored once: "
                     + ", ".join(f"{show(name)} ({rec.tensor.dtype} [{rec.block_size}]^2, /{rec.scale:g})"
                                 for name, rec in manifest.transforms.items()), soft_wrap=True)


def _transform_summary(source) -> list[dict]:
    """Online transforms grouped by scheme, type, location and block size, with the layers each covers."""
    groups: dict[tuple[str, str, str, int], list[str]] = {}
    for prefix, transforms in source.transforms.layers.items():
        for t in transforms:
            groups.setdefault((t.matrix.scheme, t.matrix.type, t.location, t.matrix.size), []).append(prefix)
    return [{"scheme": s, "type": kind, "location": loc, "block_size": b, "layers": layers}
            for (s, kind, loc, b), layers in sorted(groups.items())]


def _inspect_source(path: Path, as_json: bool) -> None:
    from ..formats import read_source

    source = read_source(path)
    shapes: dict[tuple[int, int], int] = {}
    for layer in source.layers.values():
        shapes[(layer.n, layer.k)] = shapes.get((layer.n, layer.k), 0) + 1
    info = {
        "path": str(path),
        "format": source.format,
        "quant_algo": source.quant_algo,
        "quantized_layers": len(source.layers),
        "passthrough_tensors": len(source.passthrough),
        "layer_shapes": [{"n": n, "k": k, "count": c} for (n, k), c in sorted(shapes.items())],
        "transforms": _transform_summary(source),
        "targets": [t.name for t in TARGETS],
    }
    if as_json:
        print(json.dumps(info, indent=2))
        return
    stdout.print(f"[bold]{show(source.format)}[/] {show(source.quant_algo)} checkpoint at {show(path)}")
    table = Table(title=f"{len(source.layers)} quantized layers, {len(source.passthrough)} passthrough tensors")
    for column in ("N (out)", "K (in)", "layers"):
        table.add_column(column, justify="right")
    for (n, k), count in sorted(shapes.items()):
        table.add_row(str(n), str(k), str(count))
    stdout.print(table)
    if info["transforms"]:
        table = Table(title="online transforms (weight_input / weight_output ones are already in the weights)")
        for column in ("scheme", "type", "location", "block size", "layers"):
            table.add_column(column)
        for row in info["transforms"]:
            table.add_row(show(row["scheme"]), row["type"], row["location"], str(row["block_size"]),
                          str(len(row["layers"])))
        stdout.print(table)
    stdout.print(f"possible targets: {', '.join(info['targets'])}")


def inspect(
    path: Annotated[Path, typer.Argument(help="A source model folder or a bundle folder.")],
    as_json: JsonOpt = False,
) -> None:
    """Describe a source checkpoint (format, layers, shapes) or a bundle (its manifest).

    Examples:
      nvfp4-repack inspect ./Llama-3.1-8B-NVFP4
      nvfp4-repack inspect sample-sm100 --json
    """
    from ..bundle.reader import is_bundle
    from ..verify import rank_bundles

    if not path.exists():
        raise RepackError(f"{path}: no such file or directory")
    ranks = rank_bundles(path) if path.is_dir() else []
    if ranks and as_json:
        from ..bundle.reader import open_bundle

        print(json.dumps([json.loads(open_bundle(rank).manifest.to_json()) for rank in ranks], indent=2))
        return
    for rank in ranks:
        _inspect_bundle(rank, as_json)
    if ranks:
        return
    (_inspect_bundle if is_bundle(path) else _inspect_source)(path, as_json)


def targets(as_json: JsonOpt = False) -> None:
    """List the target GPU families, their aliases, GPUs and runtime backends."""
    rows = [
        {
            "name": t.name,
            "aliases": list(t.aliases),
            "compute_capabilities": [f"{major}.{minor}" for major, minor in t.compute_capabilities],
            "backend": t.backend,
            "layout_id": t.layout_id,
            "description": t.description,
        }
        for t in TARGETS
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="targets")
    for column in ("target", "aliases", "SM", "backend", "layout", "GPUs"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], ", ".join(row["aliases"]), ", ".join(row["compute_capabilities"]),
                      row["backend"], row["layout_id"], row["description"])
    stdout.print(table)


class DeviceChoice(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


def verify(
    bundle: Annotated[Path, typer.Argument(help="The bundle folder to check.")],
    source: Annotated[
        Optional[Path],
        typer.Option(help="Source checkpoint (default: the path recorded in the manifest, if it exists)."),
    ] = None,
    device: Annotated[DeviceChoice, typer.Option(help="Where the runtime GEMM runs.")] = DeviceChoice.cpu,
    json_report: Annotated[Optional[Path], typer.Option("--json", help="Also write a JSON report to this file.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed for the random activations (default: fresh each run).")] = None,
) -> int:
    """Prove a bundle computes the same function as its source: integrity, exactness, numerics.

    A ``--tp`` output folder: every rank, and each source layer reassembled from the ranks' outputs.
    Exits 0 only when every check passes.

    Examples:
      nvfp4-repack verify sample-sm100
      nvfp4-repack verify llama-sm90 --source ./Llama-3.1-8B-NVFP4 --device cuda --json report.json
    """
    from ..bundle.reader import open_bundle
    from ..verify import rank_bundles, verify_output

    manifests = [open_bundle(b).manifest for b in rank_bundles(bundle) or [bundle]]
    total = sum(len(m.layers) + len(m.passthrough) for m in manifests)
    with Progress(TextColumn("[bold]verifying"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.description}"), console=stderr, transient=True,
                  disable=not stderr.is_terminal) as progress:
        task = progress.add_task("", total=total)
        report = verify_output(
            bundle, source=source, device=device.value, seed=seed,
            progress=lambda name: progress.update(task, advance=1, description=show(name[-48:])),
        )
    table = Table(title=f"{show(bundle)} ({report.target}, {report.backend} backend on {report.device}; "
                        f"source: {show(report.source or 'not available, numerics use the bundle decode')})")
    for column in ("layer", "status", "max rel. error", "problems"):
        table.add_column(column)
    for check in report.layers:
        error = f"{check.max_rel_error:.2e}" if check.max_rel_error is not None else "-"
        style = "green" if check.status == "ok" else "red"
        table.add_row(show(check.name), f"[{style}]{check.status}[/]", error, str(len(check.errors) or ""))
    stdout.print(table)
    for check in report.failures:
        for message in check.errors:
            stdout.print(f"[red]FAIL[/] {show(message)}", soft_wrap=True, highlight=False)
    if json_report is not None:
        json_report.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    if report.passed:
        scope = ("integrity, exactness against the source, numerics" if report.source else
                 "integrity and numerics against the bundle's own decode; no source found, so exactness was NOT "
                 "checked (pass --source)")
        matrices = f", {len(report.transforms)} transform matrices" if report.transforms else ""
        stdout.print(f"[green]PASS[/]: {len(report.layers)} layers, {len(report.passthrough)} passthrough tensors"
                     f"{matrices}, {len(report.files)} files; relative error <= {report.tolerance:g} ({scope})", soft_wrap=True)
        return 0
    stdout.print(f"[red]FAIL[/]: {len(report.failures)} check(s) failed (activation seed {report.seed})", soft_wrap=True)
    return 1


def register(app: typer.Typer) -> None:
    app.command()(convert)
    app.command()(inspect)
    app.command()(targets)
    app.command()(verify)
