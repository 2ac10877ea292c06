#!/usr/bin/env bash
# One prepared run for a session that is lent the GPU device (see DEVELOPERS.md "device").
# The device image has torch, triton, cupy, pytest, pluggy and safetensors but no vLLM and
# no network. So:
#   here, first:  .venv/bin/python benchmarks/vendor_vllm_triton.py   # -> build/gpu (ignored)
#   on the GPU:   bash benchmarks/gpu_check.sh        (carry build/gpu; timeout ~420 s)
# It runs the kernel tests compiled (no interpreter) on both conversion paths, then the
# cache-write benchmark twice (plain launches and CUDA-graph replays): kvscale's kernel
# against vLLM's own Triton kernel (from the copy in build/gpu), a CUDA baseline of
# vLLM's reshape_and_cache_flash design (benchmarks/cuda_baseline.py) and the torch
# reference. Results go under $OUT for benchmarks/RESULTS.md.
set -uo pipefail
OUT="${OUT:-/tmp/kvscale-gpu-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
COPY=build/gpu/vllm_triton_rac.py
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  $PY -c "import cupy; print('cupy', cupy.__version__)" || true
  [ -f "$COPY" ] && head -1 "$COPY" || echo "no $COPY: run benchmarks/vendor_vllm_triton.py here first"
} 2>&1 | tee "$OUT/device.txt"
# vLLM-dependent kernel tests (test_vllm_backend.py, the CPU write tests) need vLLM.
for path in auto software; do
  KVSCALE_FP8_CONVERSION=$path timeout 180 $PY -m pytest -q -p no:cacheprovider -rs \
    tests/kernels/test_fp8_cache_write.py tests/kernels/test_fp8_cache_write_aot.py 2>&1 \
    | tail -15 | tee "$OUT/kernel_tests_$path.txt"
done
VCOPY=()
[ -f "$COPY" ] && VCOPY=(--vllm-triton-copy "$COPY")
timeout 150 $PY benchmarks/cache_write.py "${VCOPY[@]}" 2>&1 | tee "$OUT/cache_write_bench.txt"
timeout 150 $PY benchmarks/cache_write.py --cuda-graph "${VCOPY[@]}" 2>&1 \
  | tee "$OUT/cache_write_bench_graph.txt"
