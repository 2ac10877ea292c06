"""Host-independent pieces both adapters use (no host engine imported)."""

from __future__ import annotations

import pytest

from kvscale_plugin.hosts._common import (
    base_version,
    claims_checkpoint,
    import_adapter,
    no_checkpoint_config_error,
)


def test_base_version():
    assert base_version("0.32.0+cpu") == "0.32.0"
    assert base_version("not-a-version") == "not-a-version"


def test_untested_version_warns_once_and_still_imports(kvscale_warnings):
    module = import_adapter("vLLM", "9.9.9", ("0.32.0",), "kvscale_plugin.scales")
    import_adapter("vLLM", "9.9.9", ("0.32.0",), "kvscale_plugin.scales")
    assert module.__name__ == "kvscale_plugin.scales"
    warnings = kvscale_warnings("not a version this plugin was tested with")
    assert len(warnings) == 1 and "vLLM 9.9.9" in warnings[0] and "0.32.0" in warnings[0]


def test_moved_internals_fail_naming_the_version():
    with pytest.raises(RuntimeError, match=r"cannot hook into SGLang 9\.9\.9 \(tested: 0\.5\.23\)"):
        import_adapter("SGLang", "9.9.9", ("0.5.23",), "kvscale_plugin._no_such_module")


def test_claims_only_compressed_tensors_when_asked():
    ct = {"quant_method": "compressed-tensors"}
    assert claims_checkpoint(ct, "kvscale") == "kvscale"
    assert claims_checkpoint(ct, None) is None
    assert claims_checkpoint({"quant_method": "fp8"}, "kvscale") is None


def test_no_checkpoint_config_message_says_what_to_do():
    text = str(no_checkpoint_config_error("vLLM"))
    assert "quantization_config" in text and "Drop --quantization kvscale" in text


def test_kvscale_follows_the_hosts_log_handlers_unless_configured():
    """vLLM's logger does not propagate: kvscale's INFO lines go through its handlers (at
    its level) -- also handlers the host sets up after plugins load, as vLLM 0.32 does in
    an in-process engine; a kvscale logger the user configured is left alone."""
    import io
    import logging

    from kvscale_plugin._log import follow_host_logging, logger

    saved = (list(logger.handlers), logger.level, list(logger.filters))
    stream = io.StringIO()
    host = logging.getLogger("kvscale-test-host")
    host.handlers = []
    host.propagate = False
    try:
        logger.handlers, logger.level, logger.filters = [], logging.NOTSET, []
        assert follow_host_logging("kvscale-test-host")
        assert not follow_host_logging("kvscale-test-host")  # once: now configured
        host.handlers = [logging.StreamHandler(stream)]  # the host configures later
        host.setLevel(logging.INFO)
        logger.info("kvscale: loaded")
        logger.debug("kvscale: not shown")
        assert stream.getvalue() == "kvscale: loaded\n"
        host.setLevel(logging.WARNING)
        logger.info("kvscale: not shown at the host's WARNING level")
        assert stream.getvalue() == "kvscale: loaded\n"
        logger.handlers, logger.level, logger.filters = [], logging.WARNING, []  # the user's
        assert not follow_host_logging("kvscale-test-host")
        assert logger.level == logging.WARNING and not logger.handlers
    finally:
        logger.handlers, logger.level, logger.filters = saved
