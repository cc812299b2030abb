# Two commands do everything: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench fuzz clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: a looser spec would pull a newer CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m onnxgrad demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

bench: $(STAMP)
	$(PY) bench/compare_torch.py --json out/bench.json

fuzz: $(STAMP)
	ONNXGRAD_FUZZ=1 $(PY) -m pytest -q tests/reliability/test_fuzz.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
