"""A CUDA stand-in for vLLM's ``reshape_and_cache_flash`` where no vLLM GPU build exists.

The lent GPU machine has torch, Triton and CuPy but no vLLM (and no network), so
vLLM's compiled CUDA cache-write op cannot run there. This is the same design,
re-implemented in ~40 lines for the benchmark: one thread block per token (padding
slots < 0 skipped), threads over ``num_heads * head_size`` in 16-byte vectors of 8
bf16 values, ``x / scale`` in float32, round-to-nearest-even with saturation
(``cvt.rn.satfinite.e4m3x2.f32``, what ``__nv_cvt_float_to_fp8(..., __NV_SATFINITE,
__NV_E4M3)`` compiles to on sm_89+), 8-byte stores into the NHD cache. It is compiled
with NVRTC through CuPy at first use (about a second). It is a baseline of the same
algorithm, not vLLM's binary: the benchmark labels it so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

SOURCE = r"""
__device__ __forceinline__ unsigned short cvt_pair(unsigned int w, float s) {
  // w holds two bf16 values: the lower address in the low half.
  float lo = __uint_as_float(w << 16) / s;
  float hi = __uint_as_float(w & 0xffff0000u) / s;
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ uint2 cvt8(uint4 v, float s) {
  uint2 out;
  out.x = (unsigned int)cvt_pair(v.x, s) | ((unsigned int)cvt_pair(v.y, s) << 16);
  out.y = (unsigned int)cvt_pair(v.z, s) | ((unsigned int)cvt_pair(v.w, s) << 16);
  return out;
}

extern "C" __global__ void rac_fp8_bf16(
    const unsigned short* __restrict__ key, const unsigned short* __restrict__ value,
    unsigned char* __restrict__ key_cache, unsigned char* __restrict__ value_cache,
    const long long* __restrict__ slot_mapping,
    long long key_stride, long long value_stride,
    long long block_stride, long long page_stride, long long head_stride,
    int num_heads, int head_size, int block_size,
    const float* k_scale, const float* v_scale) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  const long long base = (slot / block_size) * block_stride + (slot % block_size) * page_stride;
  const float ks = *k_scale;
  const float vs = *v_scale;
  const unsigned short* k_src = key + token * key_stride;
  const unsigned short* v_src = value + token * value_stride;
  const int n = num_heads * head_size;
  for (int i = threadIdx.x * 8; i < n; i += blockDim.x * 8) {
    const long long dst = base + (long long)(i / head_size) * head_stride + (i % head_size);
    uint4 k = *reinterpret_cast<const uint4*>(k_src + i);
    uint4 v = *reinterpret_cast<const uint4*>(v_src + i);
    *reinterpret_cast<uint2*>(key_cache + dst) = cvt8(k, ks);
    *reinterpret_cast<uint2*>(value_cache + dst) = cvt8(v, vs);
  }
}
"""


def make_cuda_baseline() -> Callable[[Any], None]:
    """A callable taking ``benchmarks/cache_write.py``'s ``Case``; raises when unavailable."""
    import cupy
    import numpy as np

    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise RuntimeError("cvt.rn.satfinite.e4m3x2 needs sm_89+")
    kernel = cupy.RawKernel(SOURCE, "rac_fp8_bf16", options=("-std=c++17",))
    kernel.compile()
    streams: dict[int, Any] = {}

    def run(c: Any) -> None:
        key, value, kc, vc = c.key, c.value, c.key_cache, c.value_cache
        num_tokens, num_heads, head_size = key.shape
        if c.slot_mapping.dtype != torch.int64:
            raise ValueError("the CUDA stand-in reads int64 slot mappings")
        if key.dtype != torch.bfloat16 or head_size % 8:
            raise ValueError("the CUDA stand-in handles bf16 input, head_size % 8 == 0")
        if key.stride(2) != 1 or key.stride(1) != head_size or kc.stride(3) != 1:
            raise ValueError("the CUDA stand-in needs contiguous heads")
        if (key.data_ptr() | value.data_ptr()) % 16 or (key.stride(0) * 2) % 16:
            raise ValueError("the CUDA stand-in needs 16-byte aligned rows")
        handle = torch.cuda.current_stream().cuda_stream
        stream = streams.get(handle)
        if stream is None:
            stream = streams[handle] = cupy.cuda.ExternalStream(handle)
        threads = min(512, max(32, (num_heads * head_size // 8 + 31) // 32 * 32))
        with stream:
            kernel(
                (num_tokens,),
                (threads,),
                (
                    np.uint64(key.data_ptr()),
                    np.uint64(value.data_ptr()),
                    np.uint64(kc.data_ptr()),
                    np.uint64(vc.data_ptr()),
                    np.uint64(c.slot_mapping.data_ptr()),
                    np.int64(key.stride(0)),
                    np.int64(value.stride(0)),
                    np.int64(kc.stride(0)),
                    np.int64(kc.stride(1)),
                    np.int64(kc.stride(2)),
                    np.int32(num_heads),
                    np.int32(head_size),
                    np.int32(kc.shape[1]),
                    np.uint64(c.k_scale.data_ptr()),
                    np.uint64(c.v_scale.data_ptr()),
                ),
            )

    return run
