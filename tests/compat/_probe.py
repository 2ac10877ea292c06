"""Start in-process vLLM engines, one after another, in a fresh interpreter and print what
each did.

``python _probe.py '[{"model": DIR, "quantization": null | "kvscale", "kv_cache_dtype": ...,
"simulate": null | "missing-target" | "module-fails"}, ...]'`` (one object or a list; the
process's ``simulate`` is the first run's) prints one ``RESULT {json}`` line per run: whether
the engine started (or the error it raised), teacher-forced logprobs of the model's
reference text, the scales its attention layers hold, the kvscale features installed in
this process, whether vLLM knows the ``kvscale`` method, and kvscale's warnings. On a CPU
without AVX-512 / AMX, where vLLM refuses an FP8 cache after loading the model, the scales
the engine's layers loaded are still read back (``error`` says why it did not start).

A fresh interpreter because vLLM loads plugins once per process (``VLLM_PLUGINS`` is read
then) and kvscale registers once per process. Several engines share one interpreter to
spare the ~20 s each fresh ``import vllm`` costs: what a run reports (``installed``,
``patched``, ``warnings``) is read at its end, before the next run starts -- so stock runs
listed before the first ``-q kvscale`` run see a process kvscale never activated in.

``simulate`` models a future vLLM from kvscale's side, without breaking vLLM itself:
``missing-target`` adds a target to kvscale's list that this vLLM lacks (an MTP-draft
internal "renamed"); ``module-fails`` adds a core target whose module raises on import.
"""

from __future__ import annotations

import importlib.abc
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# kvscale_testing (tests/support): a fresh interpreter, outside pytest.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

SIMULATED_MODULE = "vllm.kvscale_simulated_moved_module"


class _FailingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == SIMULATED_MODULE:
            raise RuntimeError("simulated: this module fails to import")
        return None


def _simulate(mode: str | None) -> None:
    if not mode:
        return
    from kvscale_plugin.hosts.vllm import internals

    if mode == "missing-target":
        extra = internals.Internal(
            "vllm.model_executor.model_loader.default_loader",
            "DefaultModelLoader.get_all_weights_renamed_in_a_future_vllm",
            "mtp-drafts",
            "simulated: a target this vLLM lacks",
        )
    elif mode == "module-fails":
        sys.meta_path.insert(0, _FailingFinder())
        extra = internals.Internal(
            SIMULATED_MODULE, "thing", "scales", "simulated: a core module that fails to import"
        )
    else:
        raise SystemExit(f"unknown simulate mode {mode!r}")
    internals.INTERNALS = (*internals.INTERNALS, extra)


_ORIGINAL: list[Any] = []


def _record_engine_configs() -> list[Any]:
    """Every engine config built during one run (the in-process engine shares it);
    ``_stop_recording`` puts vLLM's method back."""
    from vllm.engine.arg_utils import EngineArgs

    seen: list[Any] = []
    original = EngineArgs.create_engine_config
    _ORIGINAL[:] = [original]

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = original(self, *args, **kwargs)
        seen.append(config)
        return config

    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
    return seen


def _stop_recording() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if _ORIGINAL:
        EngineArgs.create_engine_config = _ORIGINAL.pop()  # type: ignore[method-assign]


def _scales(context: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, layer in context.items():
        if not hasattr(layer, "_k_scale"):
            continue
        out[name] = {
            "k": [float(x) for x in layer._k_scale.reshape(-1).tolist()],
            "v": [float(x) for x in layer._v_scale.reshape(-1).tolist()],
            "k_float": float(layer._k_scale_float),
            "v_float": float(layer._v_scale_float),
            "source": getattr(getattr(layer, "kvscale_record", None), "source", None),
        }
    return out


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run(args: dict[str, Any], collect: _Collect) -> dict[str, Any]:
    from kvscale_testing.checkpoints import reference_token_ids
    from kvscale_testing.patches import patched_places
    from kvscale_testing.probe import teacher_forced_logprobs, vllm_engine

    from kvscale_plugin import _log

    collect.messages = []
    _log.notices = _log.Notices()  # each run hears its own once-per-cause warnings
    result: dict[str, Any] = {"started": False, "error": None}
    ids = reference_token_ids(args["model"])
    configs = _record_engine_configs()
    try:
        with vllm_engine(
            args["model"],
            quantization=args.get("quantization"),
            kv_cache_dtype=args.get("kv_cache_dtype", "auto"),
        ) as llm:
            result["started"] = True
            result["logprobs"] = teacher_forced_logprobs(llm, ids)
            result["scales"] = _scales(
                llm.llm_engine.vllm_config.compilation_config.static_forward_context
            )
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {exc}"
        if configs:
            # vLLM refuses an FP8 cache on a CPU without AVX-512 / AMX only when it builds
            # the attention metadata, after the model (and its KV scales) loaded: what the
            # engine's layers hold by then is still read back.
            result["scales"] = _scales(configs[-1].compilation_config.static_forward_context)
    finally:
        _stop_recording()

    import vllm
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    from kvscale_plugin.hosts.vllm.process import HOST

    result["vllm"] = vllm.__version__
    result["kvscale_known"] = "kvscale" in QUANTIZATION_METHODS
    result["installed"] = sorted(HOST.installed)
    result["patched"] = patched_places()
    result["warnings"] = list(collect.messages)
    return result


def main() -> None:
    given = json.loads(sys.argv[1])
    runs = given if isinstance(given, list) else [given]
    collect = _Collect()
    logging.getLogger("kvscale_plugin").addHandler(collect)
    _simulate(runs[0].get("simulate"))
    for args in runs:
        print("RESULT " + json.dumps(run(args, collect)), flush=True)


if __name__ == "__main__":
    main()
