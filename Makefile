# One command to set up and run each job. The venv pins torch==2.13.0 (a CPU wheel on the
# dev/CI machines); the package itself accepts any torch>=2.4.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install redis serve test lint bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/loraplex serve --model demo

# redis-server for the tests that start a real Redis (apt-get as root; otherwise one line
# saying what to install).
redis:
	@sh scripts/ensure_redis.sh

test: install redis
	$(PY) -m pytest -q -ra --durations=20 $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check server kernels adapter_store loadtest tests benchmarks
	$(VENV)/bin/mypy server kernels adapter_store loadtest

bench: install
	$(PY) benchmarks/engine_bench.py --out bench-out

clean:
	rm -rf $(VENV) build *.egg-info
