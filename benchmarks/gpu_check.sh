#!/usr/bin/env bash
# One prepared run for a session that is lent the GPU device (see DEVELOPERS.md "device").
# The device image has torch, triton, pytest, pluggy and safetensors but no vLLM and no
# network: the kernel tests run compiled (no interpreter) on both conversion paths, and
# the benchmark times our kernel against the torch reference (vLLM's kernels appear only
# if a vLLM GPU build is importable there). Results go under $OUT for RESULTS.md.
#   run: bash benchmarks/gpu_check.sh      (timeout ~420 s leaves room for one rerun)
set -uo pipefail
OUT="${OUT:-/tmp/kvscale-gpu-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/device.txt"
for path in auto software; do
  KVSCALE_FP8_CONVERSION=$path timeout 150 $PY -m pytest tests/kernels -q -p no:cacheprovider \
    -k "not benchmark_smoke" 2>&1 | tail -15 | tee "$OUT/kernel_tests_$path.txt"
done
timeout 150 $PY benchmarks/cache_write.py 2>&1 | tee "$OUT/cache_write_bench.txt"
