# pagedserve: OpenAI-compatible LLM server image.
#
# Build (CUDA, the default; torch CUDA 12.4 wheels):
#   docker build -t pagedserve .
# Build for the CPU (python:3.11-slim, torch CPU wheels):
#   docker build --build-arg VARIANT=cpu -t pagedserve:cpu .
# Another torch: --build-arg TORCH_VERSION=... (with VARIANT=cuda, from the cu124 index).
#
# Run the embedded default model (SmolLM2-135M-Instruct, converted at build time):
#   docker run --gpus all -p 8000:8000 pagedserve
#   docker run -p 8000:8000 pagedserve:cpu
# Run a local Hugging Face model folder mounted under /models (extra flags are passed
# to `pagedserve serve`):
#   docker run --gpus all -p 8000:8000 -v /path/to/Qwen2.5-0.5B-Instruct:/models/qwen:ro \
#       pagedserve /models/qwen --served-model-name qwen --max-model-len 4096
# With an API key:
#   docker run -p 8000:8000 -e PAGEDSERVE_API_KEY=secret pagedserve:cpu
# The image answers GET /health; its HEALTHCHECK uses it.

ARG VARIANT=cuda
ARG TORCH_VERSION=2.6.0

# --- CUDA base: Ubuntu's Python; torch brings its CUDA libraries as wheels. ---
FROM nvidia/cuda:12.4.1-base-ubuntu22.04 AS base-cuda
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124
# Triton compiles a small C launcher at run time: it needs gcc and the Python headers.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# --- CPU base ---
FROM python:3.11-slim AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The native CPU kernels (decode attention, fused layer ops) are C compiled at first
# use for the CPU they run on (-march=native): the image keeps gcc for that. Without
# it the engine still runs, on the pure torch path.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv

# --- the image ---
# hadolint ignore=DL3006
FROM base-${VARIANT}
ARG TORCH_VERSION
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGEDSERVE_CACHE=/opt/pagedserve-cache \
    HF_HOME=/models/.hf
WORKDIR /app

# torch first: the largest layer, reused while the project changes.
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"

# The source is copied outside the working directory and removed once installed: the image
# runs the installed package only.
COPY pyproject.toml setup.py README.md /src/
COPY pagedserve /src/pagedserve
COPY engine /src/engine
COPY blockmgr /src/blockmgr
COPY kernels /src/kernels
COPY server /src/server
COPY loadtest /src/loadtest
COPY scripts/install.sh scripts/steps.sh /src/scripts/
# The same install as tests/packaging/test_install.py checks: the wheel, not editable, with
# the default model converted and the native CPU kernels built.
RUN PYTHON=python /src/scripts/install.sh \
    && rm -rf /src \
    && useradd --create-home --uid 1000 pagedserve \
    && mkdir -p /models \
    && chown -R pagedserve /models /opt/pagedserve-cache

USER 1000
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
ENTRYPOINT ["pagedserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
