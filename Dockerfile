# dspark-server images (docs/deploy.md).
#
#   docker build -t dspark-server:cpu .                  # default: CPU image, native engine, demo pair
#   docker build --target gpu -t dspark-server:gpu .     # GPU image: SGLang backend on CUDA
#
# The CPU stage is the last one, so a plain `docker build` produces it; BuildKit builds only the
# stages a target needs. Both images run as the non-root user dspark (uid 10001), listen on 8000
# and answer /health (liveness) as soon as the port is open; /ready follows once the model is loaded.

ARG PYTHON_IMAGE=python:3.11-slim
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

# ---- GPU image: `dspark serve --backend sglang` (SGLang brings its own CUDA PyTorch) -------------
# The devel base carries nvcc, which SGLang's kernels (FlashInfer, Triton) compile against at run time.
FROM ${CUDA_IMAGE} AS gpu
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
        libnuma1 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
WORKDIR /app
COPY pyproject.toml README.md ./
COPY dspark_server ./dspark_server
COPY profiles ./profiles
RUN pip install '.[sglang]' \
    && useradd --create-home --uid 10001 dspark
USER dspark
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=300s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status == 200 else 1)"
CMD ["dspark", "serve", "--backend", "sglang", "--host", "0.0.0.0", "--port", "8000"]

# ---- CPU image (default): the native engine with the bundled demo pair ----------------------------
FROM ${PYTHON_IMAGE} AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY dspark_server ./dspark_server
COPY profiles ./profiles
# g++ builds the paged-attention kernel at start-up (about a second, cached in ~/.cache)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
    && pip install --extra-index-url https://download.pytorch.org/whl/cpu '.[cpu]' \
    && useradd --create-home --uid 10001 dspark
USER dspark
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status == 200 else 1)"
CMD ["dspark", "serve", "--host", "0.0.0.0", "--port", "8000"]
