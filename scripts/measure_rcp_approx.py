"""Tabulate the GPU's ``rcp.approx.ftz.f32`` (the reciprocal NVFP4 activation quantization kernels use).

    python3 scripts/measure_rcp_approx.py repack/data/rcp_approx_ftz_f32.xz   # on any NVIDIA GPU, needs cupy

The output is what ``repack.nvfp4`` reads: per mantissa ``m`` of ``x = 1.m``, the result's distance from the
correctly rounded ``1/x`` in units in the last place, run-length encoded (uint32 count, uint16 run lengths,
int8 values, little-endian), xz-compressed. The script also checks that the result for ``x * 2^e`` is the
result for ``x`` scaled by ``2^-e`` over the normal range, which is what lets one table of 2^23 serve every input.
"""
import lzma, sys
import cupy as cp, numpy as np

K = cp.RawKernel(r'''extern "C" __global__ void k(const unsigned* a, unsigned* r, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x; if (i >= n) return;
  float y; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(__uint_as_float(a[i]))); r[i] = __float_as_uint(y);
}''', "k")


def rcp(bits: np.ndarray) -> np.ndarray:
    a = cp.asarray(bits.astype(np.uint32)); r = cp.empty_like(a)
    K(((a.size + 255) // 256,), (256,), (a, r, np.int64(a.size)))
    return r.get()


x = np.arange(1 << 23, dtype=np.uint32) + np.uint32(0x3F800000)
approx = rcp(x)
delta = approx.astype(np.int64) - (np.float32(1) / x.view(np.float32)).view(np.uint32).astype(np.int64)
g = np.random.default_rng(0); e = g.integers(-120, 120, 1 << 24); m = g.integers(0, 1 << 23, 1 << 24)
scaled = np.ldexp(approx[m].view(np.float32).astype(np.float64), -e).astype(np.float32)
assert (rcp((e + 127) << 23 | m).view(np.float32) == scaled).all(), "not exponent-independent"
starts = np.concatenate([[0], np.nonzero(np.diff(delta))[0] + 1])
lengths = np.diff(np.concatenate([starts, [delta.size]]))
assert lengths.max() < 1 << 16 and np.abs(delta).max() <= 1
blob = np.uint32(starts.size).tobytes() + lengths.astype("<u2").tobytes() + delta[starts].astype(np.int8).tobytes()
open(sys.argv[1], "wb").write(lzma.compress(blob, preset=9 | lzma.PRESET_EXTREME))
print(f"{np.count_nonzero(delta)} of {delta.size} mantissas off by one ulp; {starts.size} runs")
