"""The kernel compiles for sm_80 and sm_90 without a GPU, and each conversion
path emits the instruction it claims.

``triton.compile`` with an explicit ``GPUTarget`` needs no driver: Triton's
bundled LLVM produces the PTX (and its bundled ptxas the cubin). It must run
in a process where ``TRITON_INTERPRET`` is unset, because under the
interpreter ``@triton.jit`` yields interpreted functions that cannot be
compiled; hence the subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Triton AOT compiles (LLVM, ptxas) in a fresh process: `make test`, not `make test-fast`.
pytestmark = pytest.mark.compile
ROOT = Path(__file__).resolve().parents[2]

COMPILE_SCRIPT = r"""
import importlib, inspect, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

mod = importlib.import_module("kvscale_plugin.kernels.triton_fp8_write")
assert not mod.INTERPRETER
kernel = mod._fp8_cache_write_kernel
names = list(inspect.signature(kernel.fn).parameters)
pointers = {
    "key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": "*u8",
    "value_cache_ptr": "*u8", "slot_mapping_ptr": "*i32", "k_scale_ptr": "*fp32",
    "v_scale_ptr": "*fp32",
}
# What the launcher passes for vLLM's layout (8 KV heads x 128, block 16); unit
# head-dimension strides are constants, as Triton specializes them at launch.
constants = {
    "NUM_HEADS": 8, "HEAD_SIZE": 128, "BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128,
    "K_PER_HEAD": False, "V_PER_HEAD": False, "key_stride_d": 1, "value_stride_d": 1,
    "key_cache_stride_d": 1, "value_cache_stride_d": 1,
}
signature = {n: pointers.get(n, "constexpr" if n in constants or n == "HARDWARE_CONVERT" else "i32")
             for n in names}
# At launch Triton also specializes 16-aligned pointers and strides divisible
# by 16 (true of torch allocations and of vLLM's strides); say so here too.
attrs = {(i,): [["tt.divisibility", 16]]
         for i, n in enumerate(names) if signature[n] != "constexpr"}
results = {}
for capability, hardware in ((80, False), (90, False), (90, True)):
    values = dict(constants, HARDWARE_CONVERT=hardware)
    src = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                    constexprs={(names.index(n),): v for n, v in values.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": 4, "enable_fp_fusion": False})
    ptx = compiled.asm["ptx"]
    results[f"sm_{capability}/{'hardware' if hardware else 'software'}"] = {
        "target": re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1),
        "fp8_cvt": sorted(set(re.findall(r"cvt[.\w]*e4m3[.\w]*", ptx))),
        "div_rn": bool(re.search(r"div\.rn(\.ftz)?\.f32", ptx)),
        "div_full": "div.full.f32" in ptx,
        "vector_load": "ld.global.v4.b32" in ptx,
    }
# The hardware path on sm_80 must be refused by Triton (no e4m3 convert there).
# Record what was raised -- the outer exception and the innermost cause it wraps --
# so the test can tell Triton's fp8 refusal from any other failure.
try:
    values = dict(constants, HARDWARE_CONVERT=True)
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(n),): v for n, v in values.items()})
    triton.compile(src, target=GPUTarget("cuda", 80, 32), options={"num_warps": 4})
    results["sm_80/hardware"] = {"compiled": True}
except Exception as exc:
    chain = [exc]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    root = chain[-1]
    results["sm_80/hardware"] = {
        "compiled": False,
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "root_type": f"{type(root).__module__}.{type(root).__qualname__}",
        "root_message": str(root),
        # The innermost CompilationError quotes the kernel line that was refused.
        "where": str(chain[-2]) if len(chain) > 1 else "",
    }
print("RESULT " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "0")  # silences Triton 3.9's notice
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_software_path_compiles_for_sm80_and_sm90_without_fp8_convert(compiled: dict) -> None:
    for key, target in (("sm_80/software", "sm_80"), ("sm_90/software", "sm_90a")):
        result = compiled[key]
        assert result["target"] in (target, target.rstrip("a")), result
        assert result["fp8_cvt"] == [], f"{key} emitted {result['fp8_cvt']}"


def test_hardware_path_on_sm90_emits_the_saturating_convert(compiled: dict) -> None:
    result = compiled["sm_90/hardware"]
    assert result["fp8_cvt"] == ["cvt.rn.satfinite.e4m3x2.f32"], result


def test_hardware_path_is_refused_on_sm80(compiled: dict) -> None:
    # Triton refuses the e4m3 type itself on sm_80 (its supported fp8 types there are
    # fp8e4b15 and fp8e5): triton.language.core raises this ValueError while lowering
    # ``tl.float8e4nv``, and the code generator wraps it in a CompilationError naming
    # the source line. Any other exception (an API change, a crash) is not this refusal.
    result = compiled["sm_80/hardware"]
    assert not result["compiled"], "the e4m3 convert compiled for sm_80"
    assert result["type"] == "triton.compiler.errors.CompilationError", result
    assert result["root_type"] == "builtins.ValueError", result
    message = result["root_message"]
    assert message.startswith("type fp8e4nv not supported in this architecture."), result
    supported = message.partition("The supported fp8 dtypes are ")[2]
    assert "fp8e5" in supported and "fp8e4nv" not in supported, result
    # Refused at the hardware convert (``_e4m3_bits_hardware``), not anywhere else.
    assert "y.to(tl.float8e4nv)" in result["where"], result["where"]


def test_ieee_division_and_vector_loads_on_every_path(compiled: dict) -> None:
    for key in ("sm_80/software", "sm_90/software", "sm_90/hardware"):
        result = compiled[key]
        # div.full.f32 is not correctly rounded and would break parity with torch.
        assert result["div_rn"] and not result["div_full"], (key, result)
        assert result["vector_load"], (key, result)
