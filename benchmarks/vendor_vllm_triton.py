"""Copy vLLM's Triton cache-write kernel so the GPU benchmark can run it where vLLM is
not installed (the lent GPU machine has torch and Triton but no vLLM and no network).

    python benchmarks/vendor_vllm_triton.py [OUT_DIR]    # default build/gpu

Run it where vLLM is installed (the project's .venv): it reads vLLM's own
``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py`` and writes
``OUT_DIR/vllm_triton_rac.py`` with only the vLLM imports replaced by small stand-ins
(FP8 range, CUDA capability check, the kv-cache-dtype predicate); the kernel and its
launcher are vLLM's text, unchanged. ``build/`` is git-ignored: the copy is never
committed; ``benchmarks/cache_write.py --vllm-triton-copy`` loads it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

VLLM_IMPORTS = """from vllm.model_executor.layers.quantization.utils.quant_utils import (
    FP8_DTYPE,
    get_fp8_min_max,
)
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.kv_cache_interface import KVQuantMode
"""

STAND_INS = """# --- stand-ins for the vLLM imports (benchmarks/vendor_vllm_triton.py) ---
import enum

import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn


def get_fp8_min_max():
    return -448.0, 448.0


class _CudaPlatform:
    def has_device_capability(self, capability):
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor >= capability

    def is_rocm(self):
        return False

    def is_xpu(self):
        return False

    def fp8_dtype(self):
        return torch.float8_e4m3fn


current_platform = _CudaPlatform()


def is_quantized_kv_cache(kv_cache_dtype):
    return (
        kv_cache_dtype.startswith("fp8")
        or kv_cache_dtype.endswith("per_token_head")
        or kv_cache_dtype.startswith("nvfp4")
    )


class KVQuantMode(enum.Enum):
    INT8_PER_TOKEN_HEAD = 1
    INT4_PER_TOKEN_HEAD = 2
# --- end of stand-ins ---
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out_dir = Path(args[0] if args else "build/gpu")
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        print("vLLM is not installed here: run this in the project's .venv", file=sys.stderr)
        return 1
    import vllm

    source_path = (
        Path(spec.origin).parent / "v1" / "attention" / "ops" / "triton_reshape_and_cache_flash.py"
    )
    text = source_path.read_text()
    if VLLM_IMPORTS not in text:
        print(f"{source_path}: its imports changed; update VLLM_IMPORTS here", file=sys.stderr)
        return 1
    header = f"# Copied from vLLM {vllm.__version__}: {source_path.name} (Apache-2.0)\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "vllm_triton_rac.py"
    target.write_text(header + text.replace(VLLM_IMPORTS, STAND_INS))
    print(f"wrote {target} (vLLM {vllm.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
