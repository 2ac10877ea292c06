"""What this process's vLLM says at run time, read where the config, the KV method and the
name mapping ask: the engine being built, its parallel layout, platform and reload."""

from __future__ import annotations

import functools


def is_dummy_load() -> bool:
    """A dummy load (RL / benchmarking): no scales by design (an in-place reload brings them)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return config is not None and str(config.load_config.load_format) == "dummy"


def replays_full_cuda_graphs() -> bool:
    """The engine being built replays full CUDA graphs for some batches (what they
    captured, Python floats included, is replayed as captured)."""
    from vllm.config import get_current_vllm_config_or_none

    from kvscale_plugin.hosts.vllm.backendcopies import replays_full_graphs

    return replays_full_graphs(get_current_vllm_config_or_none())


def explicit_fp8_cache() -> bool:
    """The engine being built was given an FP8 ``--kv-cache-dtype``."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    config = get_current_vllm_config_or_none()
    dtype = getattr(getattr(config, "cache_config", None), "cache_dtype", "auto")
    return isinstance(dtype, str) and is_quantized_kv_cache(dtype)


def pipeline_parallel() -> bool:
    """This rank holds part of the model (pipeline parallelism)."""
    from vllm.distributed import get_pp_group

    try:
        return get_pp_group().world_size > 1
    except AssertionError:  # no distributed group yet
        return False


def on_cpu() -> bool:
    """vLLM's CPU platform (False where the platform cannot be read)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - no platform: not the CPU one
        return False


@functools.cache
def keeps_placeholders() -> bool:
    """Whether this vLLM's reload loads into the placeholders again (the direct reload of
    vLLM >= 0.34): post-load processing keeps them (looked up once per process)."""
    from importlib.util import find_spec

    try:
        return find_spec("vllm.model_executor.model_loader.reload.direct") is not None
    except (ImportError, ValueError):
        return False


def last_rank() -> bool:
    """This worker answers last in vLLM's executor (highest TP rank of the last pipeline
    stage), or no parallel groups exist here. vLLM 0.32's multiprocess executor reads the
    ranks' answers in order and stops at the first failure, leaving the later ranks'
    answers queued for the next ``collective_rpc``: a refusal every rank makes is raised
    by this one only."""
    try:
        from vllm.distributed import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        pp = get_pp_group()
        return (
            get_tensor_model_parallel_rank() == get_tensor_model_parallel_world_size() - 1
            and pp.rank_in_group == pp.world_size - 1
        )
    except Exception:  # noqa: BLE001 - no groups (a model built alone): this is the only rank
        return True
