"""Third-party rule packages, discovered through the installed `kvscale_plugin` entry points
(tests/rule_package is installed as a real distribution into build/test-rules by `make
test` / `make test-fast`; tests/conftest.py puts that folder on the path)."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from kvscale_plugin import names
from kvscale_plugin.names import get_plugin_manager, map_scale_name


@pytest.fixture
def fresh_manager(monkeypatch):
    monkeypatch.setattr(names, "plugin_manager", None)  # built again on first use
    return get_plugin_manager


def _installed() -> set[str]:
    return {ep.name for ep in entry_points(group="kvscale_plugin")}


def test_rule_package_is_installed():
    # A missing install must fail here, not silently skip the tests below.
    assert {"example_rules", "broken_rules"} <= _installed(), (
        "tests/rule_package is not installed: run `make test-fast` (it installs it with "
        "`pip install --no-deps --target build/test-rules ./tests/rule_package`)"
    )


def test_third_party_rule_is_consulted(fresh_manager):
    assert (
        map_scale_name("model.layers.4.attention.kv_quant.k", "vllm")
        == "model.layers.4.self_attn.attn.k_scale"
    )
    # Built-ins still answer for everything else.
    assert (
        map_scale_name("model.layers.4.self_attn.k_scale", "sglang")
        == "model.layers.4.self_attn.attn.k_scale"
    )


def test_third_party_rules_run_before_builtins(fresh_manager):
    pm = fresh_manager()
    order = [pm.get_name(impl.plugin) for impl in pm.hook.kvscale_map_scale_name.get_hookimpls()]
    # pluggy calls the last entries first.
    assert order[-1] == "example_rules" and order[0] == "kvscale-builtin"


def test_broken_package_warns_once_and_is_skipped(fresh_manager, kvscale_warnings):
    pm = fresh_manager()
    assert pm.get_plugin("broken_rules") is None
    map_scale_name("model.layers.0.self_attn.k_scale", "vllm")
    warnings = kvscale_warnings("'broken_rules'")
    assert len(warnings) == 1
    assert "failed to load" in warnings[0] and "RuntimeError" in warnings[0]


def test_the_trainer_fingerprint_takes_what_a_rule_package_maps(fresh_manager):
    """``scale_fingerprint`` keys a name only a third-party rule knows as the engine does:
    by the host name the rule maps it to (the engine fingerprints its layers, loaded
    through the same rules)."""
    import torch

    from kvscale_plugin.fingerprint import canonical_lines, entry_line, scale_fingerprint

    invented = {
        "model.layers.0.attention.kv_quant.k": torch.tensor([2.25]),
        "model.layers.0.attention.kv_quant.v": torch.tensor([3.5]),
        "model.layers.1.attention.kv_quant.k": torch.tensor([4.75]),
        "model.layers.1.attention.kv_quant.v": torch.tensor([5.125]),
        "model.layers.1.mlp.down_proj.weight": torch.ones(2, 2),  # not offered to rules
    }
    builtin = {
        f"model.layers.{i}.self_attn.{kind}_scale": t
        for (i, kind), t in zip(
            [(0, "k"), (0, "v"), (1, "k"), (1, "v")], list(invented.values())[:4], strict=True
        )
    }
    assert canonical_lines(invented) == [
        entry_line(0, "k", [2.25]),
        entry_line(0, "v", [3.5]),
        entry_line(1, "k", [4.75]),
        entry_line(1, "v", [5.125]),
    ]
    assert scale_fingerprint(invented) == scale_fingerprint(builtin)
