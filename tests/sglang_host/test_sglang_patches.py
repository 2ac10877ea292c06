"""The HookRegistry patches for SGLang 0.5.23's gaps: every target resolves on the tested
SGLang, and a target that moved is a loud error (SGLang's ``apply_hooks`` would only log
it and serve with stock behaviour), raised before anything is registered."""

from __future__ import annotations

import logging
import sys

import pytest

pytestmark = pytest.mark.usefixtures("sglang_runtime")

#: What the patches hook into on SGLang 0.5.23 (a new patch must be added here, to the
#: module docstring, and to the README's list of gaps).
EXPECTED_TARGETS = {
    "sglang.srt.model_loader.loader._initialize_model",
    "sglang.srt.model_loader.weight_utils.maybe_remap_kv_scale_name",
    "sglang.srt.model_loader.utils.get_model_architecture",
    "sglang.srt.models.qwen3.Qwen3Attention.__init__",
    "sglang.srt.models.qwen3_moe.Qwen3MoeAttention.__init__",
    "sglang.srt.models.glm4_moe.Glm4MoeAttention.__init__",
    "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
    ".update_weights_from_disk",
    *(
        "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager."
        + method
        for method in (
            "update_weights_from_disk",
            "update_weights_from_tensor",
            "update_weights_from_distributed",
            "update_weights_from_ipc",
            "end_weight_update",
        )
    ),
    "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
}

QWEN3_ATTACH = (
    "attaches the kvscale KV method to Qwen3Attention's RadixAttention, which SGLang builds "
    "without quant_config (without it, that model's KV scales are dropped)"
)


def _closing(version: str = "0.5.23") -> str:
    return (
        "SGLang's HookRegistry would only log this and serve with stock behaviour (KV scales "
        "dropped or unmapped). Install a tested SGLang (0.5.23), or a kvscale-plugin release "
        f"for SGLang {version}."
    )


def _opening(version: str = "0.5.23") -> str:
    return (
        f"kvscale: cannot patch SGLang {version}: what kvscale's patches for SGLang 0.5.23 "
        "hook into has moved, so --quantization kvscale is not registered."
    )


def _noop_hook(result: object, *args: object, **kwargs: object) -> None:
    return None


def test_every_target_resolves_on_the_tested_sglang():
    import sglang
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvscale_plugin.hosts._common import resolve_attribute
    from kvscale_plugin.hosts.sglang import TESTED_SGLANG_VERSIONS, method, patches

    assert sglang.__version__ in TESTED_SGLANG_VERSIONS
    assert patches.WRITTEN_AGAINST == sglang.__version__
    assert {p.target for p in patches.PATCHES} == EXPECTED_TARGETS
    for patch in patches.PATCHES:
        assert callable(resolve_attribute(patch.module, patch.attr)), patch.target
        assert patches.target_problem(patch) is None, patch.target
    patches.check_targets()  # raises nothing
    # ...and SGLang applies every one of them (it would only log a failure) in a process
    # that builds a kvscale model (activation: idempotent, also when an earlier test did it).
    method.activate()
    assert EXPECTED_TARGETS <= HookRegistry._patched


def test_module_docstring_lists_every_gap_and_the_version():
    from kvscale_plugin.hosts.sglang import patches

    doc = patches.__doc__ or ""
    assert f"Written against SGLang {patches.WRITTEN_AGAINST}" in doc
    # Line breaks in the docstring may fall anywhere: compare without whitespace.
    flat = "".join(doc.split())
    for target in EXPECTED_TARGETS:
        assert f"``{target}``" in flat, target


def test_a_missing_module_raises_naming_the_target(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookType

    from kvscale_plugin.hosts.sglang import patches

    moved = patches.Patch(
        "sglang.srt.no_such_module", "Loader.load", _noop_hook, HookType.AFTER, "does X"
    )
    monkeypatch.setattr(patches, "PATCHES", (*patches.PATCHES, moved))
    with pytest.raises(RuntimeError) as info:
        patches.check_targets()
    assert str(info.value) == "\n".join(
        [
            _opening(),
            "  - sglang.srt.no_such_module.Loader.load: ModuleNotFoundError: No module named "
            "'sglang.srt.no_such_module'. This patch does X.",
            _closing(),
        ]
    )


def test_a_removed_attribute_raises_naming_the_target(monkeypatch):
    from kvscale_plugin.hosts.sglang import patches

    monkeypatch.delattr(sys.modules["sglang.srt.models.qwen3"], "Qwen3Attention")
    with pytest.raises(RuntimeError) as info:
        patches.check_targets()
    assert str(info.value) == "\n".join(
        [
            _opening(),
            "  - sglang.srt.models.qwen3.Qwen3Attention.__init__: AttributeError: "
            f"'sglang.srt.models.qwen3' has no attribute 'Qwen3Attention'. This patch "
            f"{QWEN3_ATTACH}.",
            _closing(),
        ]
    )


def test_changed_parameters_raise_and_every_problem_is_listed(monkeypatch):
    """A target that is still there but takes other arguments is as moved as a missing one
    (the hooks read them by position or name); all problems come in one error."""
    import sglang
    from sglang.srt.model_loader import utils, weight_utils

    from kvscale_plugin.hosts.sglang import patches

    def maybe_remap_kv_scale_name(key: str, params: dict) -> str | None:
        return None

    monkeypatch.setattr(weight_utils, "maybe_remap_kv_scale_name", maybe_remap_kv_scale_name)
    monkeypatch.setattr(utils, "get_model_architecture", 42)
    monkeypatch.setattr(sglang, "__version__", "0.6.0")
    with pytest.raises(RuntimeError) as info:
        patches.check_targets()
    assert str(info.value) == "\n".join(
        [
            _opening("0.6.0"),
            "  - sglang.srt.model_loader.weight_utils.maybe_remap_kv_scale_name: its parameters "
            "changed: the patch reads (name, params_dict) as its first parameters, SGLang has "
            "(key, params). This patch passes already-mapped KV-scale names through SGLang's "
            "name remapping (without it, mapped scales are renamed away and not loaded).",
            "  - sglang.srt.model_loader.utils.get_model_architecture: it is no longer a "
            "function (found int). This patch keeps Mixtral's native model class under "
            "--quantization kvscale (without it, SGLang picks QuantMixtralForCausalLM, which "
            "cannot load compressed-tensors weights).",
            _closing("0.6.0"),
        ]
    )


@pytest.fixture
def unregistered(monkeypatch):
    """SGLang as before kvscale's register() ran (restored afterwards): no host state
    (``state.host``), ``kvscale`` out of the quantization registries and the CLI choices."""
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.quantization import CPU_QUANTIZATION_METHODS, QUANTIZATION_METHODS

    from kvscale_plugin.hosts import sglang as host

    monkeypatch.setattr(host.state, "host", None)
    monkeypatch.delitem(QUANTIZATION_METHODS, "kvscale")
    monkeypatch.delitem(CPU_QUANTIZATION_METHODS, "kvscale")
    saved = list(choices.QUANTIZATION_CHOICES)
    choices.QUANTIZATION_CHOICES[:] = [c for c in saved if c != "kvscale"]
    yield host
    choices.QUANTIZATION_CHOICES[:] = saved


def _kvscale_offered() -> dict[str, bool]:
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
    from sglang.srt.layers.quantization import CPU_QUANTIZATION_METHODS, QUANTIZATION_METHODS

    return {
        "methods": "kvscale" in QUANTIZATION_METHODS,
        "cpu_methods": "kvscale" in CPU_QUANTIZATION_METHODS,
        "choices": "kvscale" in QUANTIZATION_CHOICES,
    }


def _hook_counts() -> dict[str, int]:
    from sglang.srt.plugins.hook_registry import HookRegistry

    return {target: len(HookRegistry._hooks.get(target, ())) for target in EXPECTED_TARGETS}


def test_register_refuses_before_registering_anything(unregistered, monkeypatch, kvscale_warnings):
    monkeypatch.delattr(sys.modules["sglang.srt.models.qwen3_moe"], "Qwen3MoeAttention")
    hooks_before = _hook_counts()
    for _ in range(2):  # never raises into SGLang; a second attempt behaves like the first
        unregistered.register()
        assert _kvscale_offered() == {"methods": False, "cpu_methods": False, "choices": False}
        assert _hook_counts() == hooks_before
        assert unregistered.state.host is None
    said = kvscale_warnings("could not hook into SGLang")
    assert len(said) == 1, said
    assert "Qwen3MoeAttention.__init__: AttributeError" in said[0]
    assert "runs as if kvscale-plugin were not installed" in said[0]


def test_load_plugins_reports_the_moved_target_in_the_log(unregistered, monkeypatch, caplog):
    """Inside SGLang's load_plugins() (how every SGLang process runs the entry point),
    kvscale raises nothing: one warning names the moved target and kvscale is not offered,
    so ``--quantization kvscale`` is refused as an unknown choice instead of served
    half-patched, and every other start is SGLang's own."""
    import sglang.srt.plugins as plugins
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.delattr(sys.modules["sglang.srt.models.qwen3"], "Qwen3Attention")
    with caplog.at_level(logging.WARNING):
        plugins.load_plugins()
    failures = [r for r in caplog.records if r.getMessage().startswith("Failed to execute")]
    assert failures == []
    said = [
        r.getMessage() for r in caplog.records if "could not hook into SGLang" in r.getMessage()
    ]
    assert len(said) == 1, caplog.text
    assert _opening() in said[0]
    assert "sglang.srt.models.qwen3.Qwen3Attention.__init__" in said[0]
    assert _kvscale_offered() == {"methods": False, "cpu_methods": False, "choices": False}
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", "m", "--quantization", "kvscale", "--device", "cpu"])
