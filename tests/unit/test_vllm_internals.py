"""The checked list of vLLM internals, feature gating and all-or-nothing installation
(pure logic: targets here are kvscale's own modules; the real list is checked against real
vLLM releases in tests/compat)."""

from __future__ import annotations

import types

import pytest

from kvscale_plugin.hosts.vllm import callsites, internals
from kvscale_plugin.hosts.vllm.internals import Internal, check, params_problem, replace


def test_a_missing_target_costs_only_its_feature():
    report = check(
        [
            Internal("kvscale_plugin.scales", "resolve_kv_scales", "scales", "exists"),
            Internal("kvscale_plugin.scales", "no_such_function", "mtp-drafts", "moved"),
        ]
    )
    assert [f for f in internals.FEATURES if not report.available(f)] == ["mtp-drafts"]
    assert (
        "kvscale_plugin.scales.no_such_function (moved): AttributeError"
        in (report.problems["mtp-drafts"][0])
    )
    assert report.available("scales") and report.available("cpu-write")


def test_a_core_module_that_fails_to_import_costs_every_feature():
    report = check([Internal("kvscale_plugin._no_such_module", "x", "scales", "core")])
    assert not any(report.available(f) for f in internals.FEATURES)
    assert "ModuleNotFoundError" in report.problems["scales"][0]
    assert report.problems["reload-check"] == ["needs the 'scales' feature"]


def test_lazy_and_optional_targets_are_not_checked_at_registration():
    report = check(
        [
            Internal("kvscale_plugin._nope", "x", "reload-check", "call site", required=False),
            Internal("kvscale_plugin._nope", "x", "custom-backend", "heavy", lazy=True),
        ]
    )
    assert all(report.available(f) for f in internals.FEATURES)


def test_changed_parameters_are_a_problem():
    assert params_problem(("model",), ["model", "model_config"]) is None
    assert "expected (model, ...)" in params_problem(("model",), ["layer"])
    assert params_problem(("model",), None) is None  # *args: takes anything


def test_signature_change_is_reported_by_check():
    report = check(
        [Internal("kvscale_plugin.scales", "resolve_kv_scales", "mtp-drafts", "x", ("nope",))]
    )
    assert "parameters changed" in report.problems["mtp-drafts"][0]


def test_transaction_rolls_back_every_replacement():
    class Owner:
        kept = "original"

    class Child(Owner):
        pass

    module = types.ModuleType("m")
    module.func = "before"
    sizes = {"compressed-tensors": 1.0}
    with pytest.raises(RuntimeError), internals.transaction():
        replace(Child, "kept", "patched")  # inherited: rollback deletes the override
        replace(module, "func", "after")
        replace(module, "added", 1)
        internals.replace_item(sizes, "kvscale", 1.0)
        internals.replace_item(sizes, "compressed-tensors", 2.0)
        raise RuntimeError("half way")
    assert Child.kept == "original" and "kept" not in Child.__dict__
    assert module.func == "before" and not hasattr(module, "added")
    assert sizes == {"compressed-tensors": 1.0}

    with internals.transaction():
        replace(module, "func", "after")
    assert module.func == "after"


def test_register_never_raises_and_retries_cleanly(monkeypatch, kvscale_warnings):
    from kvscale_plugin.hosts import vllm as host
    from kvscale_plugin.hosts.vllm import install

    calls = []

    def broken() -> None:
        calls.append(1)
        raise ImportError("cannot import name 'inplace'")

    monkeypatch.setattr(host.HOST, "registered", False)
    monkeypatch.setattr(install, "register_method", broken)
    assert host.register() is None
    assert host.register() is None
    assert len(calls) == 2 and host.HOST.registered is False  # the second attempt is the first
    said = kvscale_warnings("could not hook into vLLM")
    assert len(said) == 1 and "cannot import name 'inplace'" in said[0], said
    assert "as if kvscale-plugin were not installed" in said[0]


def test_every_internal_names_a_known_feature_and_purpose():
    for item in internals.INTERNALS:
        assert item.feature in internals.FEATURES, item
        assert item.purpose and item.module.startswith("vllm"), item
    # Every feature has at least one required target, checked at registration or lazily.
    assert {i.feature for i in internals.INTERNALS if i.required} == set(internals.FEATURES)


def test_the_docs_list_every_internal():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "compatibility.md").read_text()
    missing = [i.target for i in internals.INTERNALS if f"`{i.target}`" not in doc]
    assert missing == [], "docs/compatibility.md lacks: " + ", ".join(missing)
    for feature in internals.FEATURES:
        assert f"**`{feature}`**" in doc, feature


def test_a_moved_target_resolves_where_it_moved():
    moved = Internal(
        "kvscale_plugin._gone", "resolve_kv_scales", "scales", "x", moved=("kvscale_plugin.scales",)
    )
    assert internals.problem(moved) is None
    nowhere = Internal(
        "kvscale_plugin._gone", "resolve_kv_scales", "scales", "x", moved=("kvscale_plugin.names",)
    )
    assert "ModuleNotFoundError" in internals.problem(nowhere)


def test_a_target_that_no_longer_calls_the_path_is_a_problem():
    calls = Internal("kvscale_plugin.scales", "resolve_kv_scales", "scales", "x", calls="_pick")
    why = internals.problem(calls)
    assert why is not None and "no longer calls _pick()" in why
    found = callsites.called_names(
        __import__("ast").parse("def f(m):\n    m.quant_method.process_weights_after_loading(m)\n")
    )
    assert "process_weights_after_loading" in found
    assert callsites.calls_problem("process_weights_after_loading", found) is None


def test_every_patched_place_says_why_and_a_kvscale_engine_patches_at_most_six():
    assert all(len(i.patch) > 40 for i in internals.PATCHED)
    # The MTP draft routing goes in only where the model declares MTP layers; the
    # data-parallel client's method runs only in the front end of a data-parallel deployment.
    plain_engine = [i for i in internals.PATCHED if i.feature not in ("mtp-drafts", "dp-answers")]
    assert len(plain_engine) <= 6, [i.target for i in plain_engine]


def test_one_feature_table_every_feature_has_its_installer_or_none():
    """``internals.FEATURES`` names each feature's installer (a function of the package);
    none only for the core and the features nothing installs up front."""
    from kvscale_plugin.hosts.vllm import activation

    assert [f for f in internals.FEATURES if activation.installer(f)] == [
        "name-parity",
        "reload-check",
        "cpu-write",
        "custom-backend",
        "rl-sync",
        "dp-answers",
    ]
    assert {f for f in internals.FEATURES if activation.installer(f) is None} == {
        "scales",
        "mtp-drafts",
        "kv-connectors",
        "deployment-check",
    }
