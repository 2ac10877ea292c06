"""A third-party rule package, as a user would write it (see the README example)."""

import re

from kvscale_plugin import hookimpl

_INVENTED = re.compile(r"^(?P<layer>.+\.layers\.\d+)\.attention\.kv_quant\.(?P<kind>[kv])$")


@hookimpl
def kvscale_map_scale_name(name, host, model_type):
    if (m := _INVENTED.match(name)) is not None:
        return f"{m['layer']}.self_attn.attn.{m['kind']}_scale"
    return None
