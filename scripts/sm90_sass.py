"""Compile the sm90 decode kernel for sm_90a on any machine (no GPU needed) and print the opcode mix of its K loop.

Needs Triton 3.6 importable (it carries ptxas and nvdisasm); used to count instructions per 32-bit word before
spending GPU time (docs/benchmarks.md, sm90 round 2).

    PYTHONPATH=/path/to/triton-site:. python scripts/sm90_sass.py SPT CHUNKS WARPS NT EVEN MAXNREG

e.g. ``1 4 8 1 1 64`` is the M <= 8 split on a layer whose K is a multiple of the step. Divisibility of pointers
and sizes by 16 is declared as Triton's launcher would specialise it at run time.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from repack.runtime.backends import triton_sm90 as backend

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SIGNATURE = {
    "x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*i32", "g_ptr": "*fp32", "y_ptr": "*bf16",
    "M": "i32", "N": "i32", "K": "i32", "KCH": "i32",
    "SPT": "constexpr", "C_T": "constexpr", "WK": "constexpr", "NT": "constexpr", "EVEN": "constexpr",
}  # fmt: skip
DIVISIBLE_BY_16 = (0, 1, 2, 3, 4, 6, 7, 8)  # the pointers, N, K and KCH


def compile_cubin(spt: int, chunks: int, warps: int, nt: int, even: int, maxnreg: int) -> bytes:
    constants = {"SPT": spt, "C_T": chunks, "WK": warps, "NT": nt, "EVEN": bool(even)}
    attrs = {(i,): [["tt.divisibility", 16]] for i in DIVISIBLE_BY_16}
    source = GluonASTSource(backend._gemv_kernel, SIGNATURE, constants, attrs)
    options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes between the K loop's label and its backward branch (the last conditional branch to a label)."""
    target = re.findall(r"@!?P\d BRA `\((\.L_x_\d+)\)", sass)[-1]
    body = sass[sass.index(f"{target}:") : sass.rindex(f"BRA `({target})")]
    return collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", body, re.M))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("spt", "chunks", "warps", "nt", "even", "maxnreg"):
        parser.add_argument(name, type=int)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "gemv.cubin"
        cubin.write_bytes(compile_cubin(args.spt, args.chunks, args.warps, args.nt, args.even, args.maxnreg))
        usage = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True, check=True)
        sass = subprocess.run([BIN / "nvdisasm", "-c", cubin], capture_output=True, text=True, check=True).stdout
    print(" ".join(line.strip() for line in usage.stdout.splitlines() if "REG:" in line))
    ops = loop_opcodes(sass)
    words = args.spt * args.chunks * 4  # 16-byte runs of 4 words per thread, stripe and chunk
    total = sum(ops.values())
    print(f"K loop: {total} instructions for {words} words per thread = {total / words:.1f} per word")
    for op, count in ops.most_common():
        print(f"  {count:4d} {op}")


if __name__ == "__main__":
    main()
