"""Extension points of kvscale-plugin (pluggy project ``kvscale``).

A third-party package adds rules by exposing a module (or object) with
``@kvscale_plugin.hookimpl`` functions under the entry-point group
``kvscale_plugin``::

    [project.entry-points.kvscale_plugin]
    my_rules = "my_rules_package"

Third-party rules are consulted before the built-in ones (which are registered
as an ordinary plugin, ``kvscale_plugin.names``, through this same hook).
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "kvscale"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec(firstresult=True)
def kvscale_map_scale_name(name: str, host: str, model_type: str | None) -> str | None:
    """Map a checkpoint KV-scale tensor name to the host's parameter name.

    :param name: the tensor name as stored in the checkpoint, e.g.
        ``model.layers.3.self_attn.k_scale``.
    :param host: ``"vllm"`` or ``"sglang"``.
    :param model_type: the checkpoint's ``config.json`` ``model_type`` (``"llama"``,
        ``"qwen3_moe"``, ...) or None when unknown.
    :return: the host parameter name (e.g. ``model.layers.3.self_attn.attn.k_scale``),
        or None to let the next rule decide. The first non-None answer wins.
        Names that are not KV scales must be passed (return None).
    """
