"""An engine that never asked for kvscale runs vLLM's own code.

Operators install kvscale into the image that runs all their engines. With kvscale
installed (found by vLLM through its entry point in every process), an engine started
without ``--quantization kvscale`` has no vLLM attribute whose code is kvscale's -- in
this process, in-process engines and a multiprocess engine's worker alike -- and kvscale
logs nothing, also on a vLLM release kvscale was not tested with. (The kvscale engine's
own count is in test_vllm_processes.py.) One fresh interpreter: a stock engine must not
share a process with a kvscale one.
"""

from __future__ import annotations

import pytest
from _run_script import run_script
from kvscale_testing.skips import KV_DTYPE, follows_cpu_fp8

pytestmark = pytest.mark.engine


@follows_cpu_fp8
def test_a_stock_engine_runs_vllms_own_code_and_hears_nothing_of_kvscale(tiny, tmp_path):
    plain = tiny("untouched-plain", quantization_config=False, write_scales=False)
    compressed = tiny("untouched-ct", num_layers=2)
    output: list[str] = []
    result = run_script(
        "_stock_engine.py",
        str(plain),
        str(compressed),
        tmp_path=tmp_path,
        output=output,
        env={"KVSCALE_TEST_KV_DTYPE": KV_DTYPE},
    )
    assert result["registered"], result  # kvscale was there: registered, and nothing more
    for run in ("in-process plain", "in-process compressed-tensors", "multiprocess worker"):
        assert result[run]["tokens"] == 4, (run, result[run])
        assert result[run]["patched"] == [], (run, result[run])
    assert result["in-process compressed-tensors"]["quantization"] == "compressed-tensors"
    assert result["front end patched"] == []
    assert result["kvscale records"] == []
    # Every line kvscale logs starts "kvscale: " (paths may contain "kvscale" anywhere:
    # the checkout's folder, the venv's site-packages).
    printed = [line for text in output for line in text.splitlines() if "kvscale: " in line]
    assert printed == [], printed
