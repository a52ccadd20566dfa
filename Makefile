# `make test` and `make demo` set up .venv on first use (offline-safe afterwards).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.keras-amp-installed
PYTEST_ARGS ?=
# Test processes (pytest-xdist): the suite is mostly single-threaded tracing, so two processes on
# two cores take half the time; at most 4 (each TensorFlow process holds ~1-2 GB).
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
QUICK ?=
BENCH_ARGS ?=

# The scripts filter TensorFlow's start-up banner themselves; a TF_CPP_MIN_LOG_LEVEL set here would keep it
# (TF 2.21 writes it before absl's log is initialised, whatever the level; a level the user set is theirs).
.PHONY: test demo doctor bench pictures clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) examples/demo.py

doctor: $(STAMP)
	$(VENV)/bin/keras-amp doctor

# Step time and memory of the workloads (benchmarks/RESULTS.md), then (QUICK=1 leaves them out) the
# weight state's memory: frozen weights, the lean tier, LoRA (benchmarks/LEAN_RESULTS.md), and where
# a step's time goes, op by op, with the matmul/conv-only limit (printed), and keras-hub's backbones
# under float32, stock and keras_amp (benchmarks/HUB_RESULTS.md).
bench: $(STAMP)
	QUICK=$(QUICK) $(PY) benchmarks/run_all.py $(BENCH_ARGS)
	if [ -z "$(QUICK)" ] || [ "$(QUICK)" = 0 ]; then $(PY) benchmarks/bench_lean.py; fi
	if [ -z "$(QUICK)" ] || [ "$(QUICK)" = 0 ]; then $(PY) benchmarks/profile_step.py; fi
	if [ -z "$(QUICK)" ] || [ "$(QUICK)" = 0 ]; then $(PY) benchmarks/bench_hub.py; fi

# README's pictures, docs/*.png, at small settings (a few minutes): the demo's, a QUICK=1
# benchmark's (its report to a temporary folder, not benchmarks/RESULTS.md) and a precision plan.
pictures: $(STAMP)
	$(PY) examples/demo.py --epochs=4 --steps_per_epoch=20 --width=64 --depth=2 \
		--verbose=0 --plot_file=docs/demo.png
	QUICK=1 $(PY) benchmarks/run_all.py --results "$$(mktemp -d)/RESULTS.md" --plot docs/bench.png
	$(PY) docs/plan_example.py docs/plan.png

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
