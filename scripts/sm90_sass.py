"""Compile the sm90 kernels for sm_90a on any machine (no GPU needed) and print what their loops issue.

Needs Triton 3.6 importable (it carries ptxas and nvdisasm); used to count instructions and check the wgmma
pipeline before spending GPU time (docs/benchmarks.md, sm90 rounds 2 and 3).

    PYTHONPATH=/path/to/triton-site:. python scripts/sm90_sass.py gemv SPT CHUNKS WARPS NT EVEN MAXNREG
    PYTHONPATH=/path/to/triton-site:. python scripts/sm90_sass.py tc BM WARPGROUPS STAGES PER_SM SPLIT

``gemv 1 4 8 1 1 64`` is the decode kernel's M <= 8 split on a layer whose K is a multiple of the step: the opcode
mix of its K loop per 32-bit word. ``tc 128 2 4 1 0`` is the tensor-core kernel for M = 65..256: its consumer loop's
size, barriers and wgmma waits, and every write to a register that an in-flight wgmma still reads as its A
operand (none may exist: ``_TC_CHUNKS``). Divisibility of pointers and sizes by 16 is declared as Triton's launcher
would specialise it at run time.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from repack.runtime.backends import triton_sm90 as backend

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)$")


def compile_sass(kernel, signature: dict, constants: dict, divisible: tuple[int, ...], options: dict) -> str:
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    source = GluonASTSource(kernel, signature, constants, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([BIN / "cuobjdump", "-res-usage", path], capture_output=True, text=True, check=True)
        print(" ".join(line.strip() for line in usage.stdout.splitlines() if "REG:" in line),
              f"dynamic shared memory: {compiled.metadata.shared} bytes")  # fmt: skip
        return subprocess.run([BIN / "nvdisasm", "-c", path], capture_output=True, text=True, check=True).stdout


def innermost_loop(sass: str, marker: str) -> list[tuple[str, str]]:
    """(opcode, operands) of the shortest backward-branch loop that contains ``marker``."""
    lines = sass.splitlines()
    labels = {line.split(":")[0]: i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:", line)}
    best: list[str] | None = None
    for i, line in enumerate(lines):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), i) < i:
            body = lines[labels[target.group(1)] : i + 1]
            if any(marker in b for b in body) and (best is None or len(body) < len(best)):
                best = body
    assert best is not None, f"no loop with {marker}"
    return [(m.group(1), m.group(2)) for m in map(INSTRUCTION.match, best) if m]


def gemv(args: list[int]) -> None:
    spt, chunks, warps, nt, even, maxnreg = args
    signature = {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*i32", "g_ptr": "*fp32", "y_ptr": "*bf16", "M": "i32",
                 "N": "i32", "K": "i32", "KCH": "i32", "SPT": "constexpr", "C_T": "constexpr", "WK": "constexpr",
                 "NT": "constexpr", "EVEN": "constexpr"}  # fmt: skip
    constants = {"SPT": spt, "C_T": chunks, "WK": warps, "NT": nt, "EVEN": bool(even)}
    options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    sass = compile_sass(backend._gemv_kernel, signature, constants, (0, 1, 2, 3, 4, 6, 7, 8), options)
    ops = collections.Counter(op for op, _ in innermost_loop(sass, "HMMA"))
    words = spt * chunks * 4  # 16-byte runs of 4 words per thread, stripe and chunk
    print(f"K loop: {sum(ops.values())} instructions for {words} words per thread = {sum(ops.values()) / words:.1f} per word")
    for op, count in ops.most_common():
        print(f"  {count:4d} {op}")


def wgmma_register_hazards(loop: list[tuple[str, str]]) -> list[str]:
    """Writes to registers that an issued, not yet retired HGMMA reads as its A operand (loop run twice)."""
    hazards, groups, open_group = [], [], set()  # groups: A registers per committed wgmma group, oldest first
    for op, operands in loop * 2:
        if op.startswith("HGMMA"):
            first = int(re.search(r"R\d+, R(\d+), gdesc", operands).group(1))
            open_group |= set(range(first, first + 4))
            if "gsb0" in operands:
                groups.append(open_group)
                open_group = set()
        elif op.startswith("WARPGROUP.DEPBAR"):
            del groups[: max(0, len(groups) - int(operands.split("0x")[1].rstrip(" ;"), 16))]
        elif (dest := re.match(r"\s*R(\d+)", operands)) and not op.startswith(("ST", "BAR", "SYNCS", "BRA")):
            width = 4 if ".128" in op else 2 if ".64" in op else 1
            written = set(range(int(dest.group(1)), int(dest.group(1)) + width))
            if any(written & regs for regs in [*groups, open_group]):
                hazards.append(f"{op}{operands}")
    return hazards


def tc(args: list[int]) -> None:
    bm, warpgroups, stages, per_sm, split = args
    config = backend.TcConfig(bm, warpgroups, stages, per_sm)
    n, k = 8192, 8192
    descs = backend.tc_descriptors(
        torch.empty(bm, k, dtype=torch.bfloat16),
        torch.empty(*backend.layout.runtime_specs(n, k)["weight"].shape, dtype=torch.int32),
        torch.empty(*backend.layout.runtime_specs(n, k)["weight_scale"].shape, dtype=torch.float8_e4m3fn),
        config,
    )
    names = ("x_desc", "w_desc", "s_desc")
    signature = {name: native_specialize_impl(BaseBackend, d, False, True, True)[0] for name, d in zip(names, descs)}
    signature |= {"g_ptr": "*fp32", "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32",
                  "N": "i32", "STEPS": "i32", "TOTAL_STEPS": "i32", "SPLIT_K": "i32"}  # fmt: skip
    launch = backend.tc_launch_options(config)
    options = {key: launch.pop(key) for key in ("num_warps", "maxnreg", "launch_pdl")}
    constants = {**launch, "SPLIT": bool(split)}
    signature |= {name: "constexpr" for name in constants}
    sass = compile_sass(backend._tc_kernel, signature, constants, (3, 4, 5, 6, 8), options)
    loop = innermost_loop(sass, "HGMMA")
    ops = collections.Counter(op for op, _ in loop)
    waits = collections.Counter(operands.strip(" ;") for op, operands in loop if op.startswith("WARPGROUP.DEPBAR"))
    print(f"consumer loop: {len(loop)} instructions, {ops['BAR.SYNC.DEFER_BLOCKING']} CTA-partition barriers, "
          f"HGMMA {sum(c for op, c in ops.items() if op.startswith('HGMMA'))}, waits {dict(waits)}")  # fmt: skip
    hazards = wgmma_register_hazards(loop)
    print(f"writes to A registers of in-flight wgmmas: {len(hazards)}", *hazards[:5], sep="\n  ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=("gemv", "tc"))
    parser.add_argument("values", type=int, nargs="+")
    args = parser.parse_args()
    (gemv if args.kernel == "gemv" else tc)(args.values)


if __name__ == "__main__":
    main()
