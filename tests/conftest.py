"""Test-wide setup: in-process vLLM engines, private caches, tiny local checkpoints."""

from __future__ import annotations

import os
import tempfile

# Before vLLM is imported anywhere: in-process engines (attention layers readable),
# caches and temp files in a private folder.
_ROOT = tempfile.mkdtemp(prefix="kvscale-tests-")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(_ROOT, "vllm-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# kvscale's compiled CPU FP8 write is built from its C source in this run (as on a
# fresh machine), never taken from the user's cache.
os.environ.setdefault("KVSCALE_NATIVE_DIR", os.path.join(_ROOT, "native"))
# Nothing the tests run (this process or the ones it starts) writes into the user's home:
# what defaults to ~/.cache ($XDG_CACHE_HOME: Hugging Face, pip, matplotlib, torch hub,
# kvscale's own caches), matplotlib's ~/.config folder and Triton's ~/.triton (the AOT
# compile tests) live in the private folder too. Set, not defaulted: a user's own value
# points into the user's cache as well.
os.environ["XDG_CACHE_HOME"] = os.path.join(_ROOT, "cache")
os.environ["HF_HOME"] = os.path.join(_ROOT, "cache", "huggingface")
os.environ["MPLCONFIGDIR"] = os.path.join(_ROOT, "matplotlib")
os.environ["TRITON_HOME"] = _ROOT
os.environ.pop("TRITON_CACHE_DIR", None)  # under TRITON_HOME
# Every process the tests start notes its first `import vllm` here (tests/support/amx_site,
# on PYTHONPATH under `make`): the session summary counts them.
# One log for the whole run: pytest-xdist's workers inherit the controller's variable.
PROCESS_LOG = os.environ.setdefault(
    "KVSCALE_TEST_PROCESS_LOG", os.path.join(_ROOT, "vllm-processes.log")
)

import importlib.util  # noqa: E402
import sys  # noqa: E402

# A test that reaches vLLM's FP8 CPU path must declare it (tests/support/amx_site/
# kvscale_fp8_guard.py): guarded in this process from here on, and in every process it
# starts (sitecustomize.py there, on PYTHONPATH under `make`). Each process's hits are
# written to its own log, read after each test (pytest_runtest_makereport below).
_AMX_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support", "amx_site")
if _AMX_SITE not in sys.path:
    sys.path.append(_AMX_SITE)
import kvscale_fp8_guard  # noqa: E402

FP8_GUARD_LOG = os.path.join(_ROOT, "fp8-guard.log")
os.environ[kvscale_fp8_guard.ENV_LOG] = FP8_GUARD_LOG
os.environ.pop(kvscale_fp8_guard.ENV_DECLARED, None)
kvscale_fp8_guard.install()

# The test-only third-party rule package (tests/rule_package), installed by `make test`
# as a real distribution into build/test-rules -- a folder only the tests see, so its
# entry points are discovered as a user's package would be without touching .venv.
TEST_RULES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "test-rules"
)
if os.path.isdir(TEST_RULES) and TEST_RULES not in sys.path:
    sys.path.insert(0, TEST_RULES)

# tests/sglang_host needs SGLang, which lives in its own venv (.venv-sglang; `make
# test-sglang`). Elsewhere the folder is excluded here, visibly (see the report header),
# rather than each test skipping.
_HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
collect_ignore = [] if _HAVE_SGLANG else ["sglang_host", "sglang_engine"]


def pytest_report_header(config: object) -> list[str]:
    where = (
        TEST_RULES
        if os.path.isdir(TEST_RULES)
        else ("MISSING (run `make test` or `make test-fast` to install it)")
    )
    lines = [f"kvscale test rule package: {where}", _fp8_header()]
    if not _HAVE_SGLANG:
        lines.append(
            "tests/sglang_host and tests/sglang_engine excluded: no SGLang here; "
            "`make test-sglang` runs them in .venv-sglang"
        )
    return lines


import gc  # noqa: E402
import logging  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from kvscale_testing.tinymodels import TinySpec, build_tiny_checkpoint  # noqa: E402

from kvscale_plugin import _log  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    # warn_once is per process; each test must see its own warnings.
    monkeypatch.setattr(_log, "notices", _log.Notices())


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny(tiny_cache: Path) -> Callable[..., Path]:
    """``tiny(name, **TinySpec fields)`` -> a checkpoint dir, built once per session."""
    built: dict[str, Path] = {}

    def make(name: str, **fields: object) -> Path:
        if name not in built:
            built[name] = build_tiny_checkpoint(
                tiny_cache / name, TinySpec(**fields), cache_dir=tiny_cache
            )
        return built[name]

    return make


@pytest.fixture
def kvscale_warnings(caplog: pytest.LogCaptureFixture) -> Callable[[str], list[str]]:
    """Messages the plugin logged at WARNING that contain a substring."""
    caplog.set_level(logging.WARNING, logger="kvscale_plugin")

    def matching(text: str) -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name.startswith("kvscale_plugin") and text in r.getMessage()
        ]

    return matching


# vLLM's CPU attention runs an FP8 KV cache only on x86 with AVX-512 or AMX; on other CPUs
# it refuses one ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX"), after the model
# and its KV scales loaded. A test that needs an FP8 cache says so up front with the
# ``needs_fp8_cpu_cache`` marker and is skipped before it runs on such a CPU, with the
# reason; nothing turns a failure into a skip afterwards (a refusal in a test without the
# marker is a failure: the marker is missing). Behaviours that do not need FP8 run there
# on a bf16 cache instead (``kvscale_testing.skips.KV_DTYPE``).
from kvscale_testing.skips import AVX512_TP_SKIP_REASON, CPU_FP8, FP8_SKIP_REASON  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if CPU_FP8:
        return
    skips = {
        "needs_fp8_cpu_cache": pytest.mark.skip(reason=FP8_SKIP_REASON),
        "needs_avx512_cpu_for_tp": pytest.mark.skip(reason=AVX512_TP_SKIP_REASON),
    }
    for item in items:
        for marker, skip in skips.items():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)
                break


def _fp8_guard_log_size() -> int:
    try:
        return os.path.getsize(FP8_GUARD_LOG)
    except OSError:
        return 0


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: object) -> object:
    """The test's declaration (a marker in ``kvscale_fp8_guard.MARKERS``) is in the
    environment from its set-up to its teardown: the guard reads it, in this process and
    in every engine process the test (or a fixture it sets up) starts."""
    declared = [m for m in kvscale_fp8_guard.MARKERS if item.get_closest_marker(m)]
    if declared:
        os.environ[kvscale_fp8_guard.ENV_DECLARED] = declared[0]
    else:
        os.environ.pop(kvscale_fp8_guard.ENV_DECLARED, None)
    item.stash[_GUARD_LOG_START] = _fp8_guard_log_size()
    try:
        yield
    finally:
        os.environ.pop(kvscale_fp8_guard.ENV_DECLARED, None)


_GUARD_LOG_START = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    """A guard hit fails the test even where the test swallowed the error it raised."""
    outcome = yield
    report = outcome.get_result()
    start = item.stash.get(_GUARD_LOG_START, None)
    if start is None or _fp8_guard_log_size() <= start:
        return
    with open(FP8_GUARD_LOG, encoding="utf-8") as log:
        log.seek(start)
        hits = log.read().strip()
    item.stash[_GUARD_LOG_START] = _fp8_guard_log_size()  # reported once
    title = "undeclared use of vLLM's FP8 CPU path (kvscale_fp8_guard)"
    if report.failed:
        report.sections.append((title, hits))
    else:
        report.outcome = "failed"
        report.longrepr = f"{title}:\n{hits}"


def _fp8_header() -> str:
    """One header line: whether this CPU runs the FP8 cache tests."""
    return "CPU FP8 KV cache: " + ("runs (AVX-512 or AMX)" if CPU_FP8 else FP8_SKIP_REASON)


# -- engine starts, counted for the session summary (what the suite's time goes into) ------

_IN_PROCESS_ENGINES = [0]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the first engine test: count the engines built in this process (vLLM's
    ``EngineCore.__init__``, wrapped in the test process only), and let each engine start
    on a frozen heap (``gc.freeze()``): vLLM runs six to nine full garbage collections while
    it builds an engine, each ~0.4 s over the ~700,000 objects of a process that imported
    vLLM and torch -- most of an in-process engine start here. vLLM's own shutdown
    unfreezes the heap again (``EngineCore.shutdown``), so nothing is kept alive longer
    than that engine."""
    if item.get_closest_marker("engine") is None:
        return
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return
    if getattr(EngineCore.__init__, "_kvscale_test_counter", False):
        return
    original = EngineCore.__init__

    def __init__(self: object, *args: object, **kwargs: object) -> None:
        _IN_PROCESS_ENGINES[0] += 1
        gc.freeze()
        original(self, *args, **kwargs)

    __init__._kvscale_test_counter = True  # type: ignore[attr-defined]
    EngineCore.__init__ = __init__  # type: ignore[method-assign]


def pytest_sessionfinish(session: pytest.Session) -> None:
    # A pytest-xdist worker hands its count to the controller (``pytest_testnodedown``).
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["kvscale_in_process_engines"] = _IN_PROCESS_ENGINES[0]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    _IN_PROCESS_ENGINES[0] += int(
        getattr(node, "workeroutput", {}).get("kvscale_in_process_engines", 0)
    )


def pytest_terminal_summary(terminalreporter: object) -> None:
    try:
        with open(PROCESS_LOG, encoding="utf-8") as log:
            processes = [line for line in log if line.strip()]
    except OSError:
        processes = []
    write = terminalreporter.write_line  # type: ignore[attr-defined]
    write(
        f"engine starts: {_IN_PROCESS_ENGINES[0]} in-process engine(s) in the test process(es); "
        f"{len(processes)} fresh process(es) imported vLLM (probes, engine cores, workers, "
        "servers, CLI calls; each pays ~15-20 s for the import)"
    )
