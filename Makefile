# Two commands do everything: `make demo` and `make test`. Each creates .venv when missing, from the
# lock (requirements/lock.txt), so a clean clone tests the same versions on any date.
# Two more legs tell us about drift before users do: `make test-latest` (every dependency at its newest
# release, no lock) and `make test-oldest` (every dependency at the lower bound pyproject.toml declares).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LOCK := requirements/lock.txt
STAMP := $(VENV)/.installed
PIP_QUIET := --quiet --disable-pip-version-check
# torch first: a spec pip could satisfy with a newer release pulls a CUDA build of several GB.
TORCH := torch==2.13.0
# the locked venv also holds the zoo extra (transformers, onnxscript): make test runs tests/zoo;
# and the federated extra (flwr): make test runs tests/federated
EXTRAS := dev,zoo,federated

.PHONY: demo test test-numerics test-latest test-oldest test-wheel test-js test-web lint bench bench-js fuzz mutate lock clean docs-coverage docs

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_QUIET) -c $(LOCK) $(TORCH)
	$(PY) -m pip install $(PIP_QUIET) -c $(LOCK) -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m onnxgrad demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

# The numerical tests and the machine they ran on (out/numerics.json), from the checkout: in .venv
# (made from the lock when missing); on a machine without the registry, any python that has the
# dependencies, NUMERICS_PYTHON=/path/to/python (nothing is installed then). docs/numerics.md
NUMERICS_PYTHON ?=
test-numerics: $(if $(NUMERICS_PYTHON),,$(STAMP))
	PYTHONPATH=src $(or $(NUMERICS_PYTHON),$(PY)) tools/numerics.py --out out/numerics.json

# Newest releases of everything (torch included, as far as pip may take it), no lock.
.venv-latest/.installed: pyproject.toml
	rm -rf .venv-latest && $(PYTHON) -m venv .venv-latest
	.venv-latest/bin/python -m pip install $(PIP_QUIET) --upgrade pip
	.venv-latest/bin/python -m pip install $(PIP_QUIET) --upgrade --upgrade-strategy eager -e ".[dev,federated]"
	.venv-latest/bin/python -m pip list --disable-pip-version-check | grep -iE "^(onnx|onnxruntime|numpy|torch|scikit-learn|skl2onnx) "
	touch $@

test-latest: .venv-latest/.installed
	.venv-latest/bin/python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider

# Every dependency at the lower bound pyproject.toml declares (tools/lower_bounds.py).
.venv-oldest/.installed: pyproject.toml $(LOCK) tools/lower_bounds.py
	rm -rf .venv-oldest && $(PYTHON) -m venv .venv-oldest
	$(PYTHON) tools/lower_bounds.py pyproject.toml $(LOCK) > .venv-oldest/constraints.txt
	.venv-oldest/bin/python -m pip install $(PIP_QUIET) -c .venv-oldest/constraints.txt $(TORCH)
	.venv-oldest/bin/python -m pip install $(PIP_QUIET) -c .venv-oldest/constraints.txt -e ".[dev]"
	.venv-oldest/bin/python -m pip list --disable-pip-version-check | grep -iE "^(onnx|onnxruntime|numpy|torch|scikit-learn|skl2onnx) "
	touch $@

test-oldest: .venv-oldest/.installed
	.venv-oldest/bin/python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider

# Installed as users install it: the wheel (not editable) in a clean venv, then a smoke script.
test-wheel: $(STAMP)
	rm -rf dist .venv-wheel
	$(PY) -m build --quiet --sdist --wheel --outdir dist .
	$(PYTHON) -m venv .venv-wheel
	.venv-wheel/bin/python -m pip install $(PIP_QUIET) -c $(LOCK) $(TORCH)
	.venv-wheel/bin/python -m pip install $(PIP_QUIET) -c $(LOCK) "$$(ls dist/onnxgrad-*.whl)[torch,sklearn,train]"
	cd /tmp && $(CURDIR)/.venv-wheel/bin/python $(CURDIR)/tools/wheel_smoke.py

# docs/coverage.md: its introduction, then what `onnxgrad coverage --markdown` prints (tests/test_docs.py
# compares them exactly).
docs-coverage: $(STAMP)
	sed '/^| op |/,$$d' docs/coverage.md > docs/coverage.md.new
	$(PY) -m onnxgrad coverage --markdown >> docs/coverage.md.new
	mv docs/coverage.md.new docs/coverage.md

# The documentation site with the API reference from the docstrings (mkdocs.yml; docs/reference/):
# the docs extra from the lock, then a strict build (any warning, broken link or anchor fails) into out/site.
docs: $(STAMP)
	$(PY) -m pip install $(PIP_QUIET) -c $(LOCK) -e ".[docs]"
	$(PY) -m mkdocs build --strict

# Refresh the lock: resolve the dev, zoo and docs extras afresh in a throwaway venv and freeze it.
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install $(PIP_QUIET) $(TORCH)
	.venv-lock/bin/python -m pip install $(PIP_QUIET) ".[$(EXTRAS),docs]"
	(echo "# pip constraints for make test / make demo; refresh with: make lock"; \
	 .venv-lock/bin/python -m pip freeze --disable-pip-version-check --exclude onnxgrad) > $(LOCK)
	rm -rf .venv-lock

# The JavaScript runner (js/) on onnxruntime-node against the Python runner: the fixture (the digits
# MLP's training folder and the Python losses) is written by js/test/make_fixture.py.
# js/test/package.test.js packs the package and installs it into a fresh project (npm registry).
# ONNXRUNTIME_NODE_INSTALL=skip: onnxruntime-node's postinstall downloads CUDA binaries from NuGet
test-js: $(STAMP)
	cd js && ONNXRUNTIME_NODE_INSTALL=skip npm ci --no-audit --no-fund
	$(PY) js/test/make_fixture.py js/test/fixture
	$(PY) js/test/make_ort_training_fixture.py js/test/ort_training_fixture
	cd js && node --test test/*.test.js

# The browser: examples/web/ trains the digits MLP and CNN with onnxruntime-web (wasm) in headless chromium
# (installed with apt-get when missing, or CHROMIUM=/path), served from localhost, then on its WebGPU
# provider (chromium's software adapter, --enable-unsafe-webgpu; the first steps; WEBGPU=0 skips it); also
# onnxruntime-web in Node. Then ort_training.html: the migrated example of docs/migrate_ort_training.md with
# the former TrainingSession names, against the Python API. Writes examples/web/out/screenshot.png (or
# $$SCREENSHOT).
test-web: $(STAMP)
	command -v chromium >/dev/null || [ -n "$${CHROMIUM:-}" ] || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)
	cd examples/web && npm ci --no-audit --no-fund
	$(PY) js/test/make_fixture.py examples/web/fixture
	$(PY) examples/web/make_ort_training_fixture.py examples/web/fixture/ort_training
	cd examples/web && node test-web.mjs

# The layer contract (docs/architecture.md): every import looks down, no import cycle.
lint: $(STAMP)
	$(PY) -m ruff check src tests bench tools
	$(PY) -m ruff format --check src tests bench tools
	$(PY) tools/check_layers.py

bench: $(STAMP)
	$(PY) bench/compare_torch.py --json out/bench.json
	$(PY) bench/floors.py --json out/floors.json
	$(PY) bench/recompute.py --json out/recompute.json

# onnxgrad's steps against TensorFlow.js on the same models and weights, one thread, in Node
# (onnxruntime-node, onnxruntime-web wasm; tfjs cpu, wasm) and in headless chromium (onnxruntime-web
# wasm and WebGPU; tfjs cpu, wasm). bench/js/ has its own package.json: tfjs is never a dependency of
# onnxgrad. Writes out/bench_js.json; docs/performance.md reports it.
bench-js: $(STAMP)
	command -v chromium >/dev/null || [ -n "$${CHROMIUM:-}" ] || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)
	cd bench/js && npm ci --no-audit --no-fund
	$(PY) js/test/make_fixture.py bench/js/fixture
	cd bench/js && node bench.mjs fixture --json ../../out/bench_js.json

fuzz: $(STAMP)
	ONNXGRAD_FUZZ=1 $(PY) -m pytest -q tests/reliability/test_fuzz.py

# Mutation testing (tools/mutate.py): mutmut 3.8 on MODULES (paths under src/onnxgrad, or dotted
# names) with the tests that cover them (TESTS=... to choose them), in a scratch copy under
# out/mutate; prints the survivors and each module's score. mutmut is installed here, into .venv
# within the lock's versions, not by the lock itself: `make test` never needs it.
MUTMUT := mutmut>=3.8,<3.9
mutate: $(STAMP)
	@test -n "$(MODULES)" || { echo "usage: make mutate MODULES='src/onnxgrad/model/limits.py ...' [TESTS='tests/...']"; exit 2; }
	$(PY) -m pip install $(PIP_QUIET) -c $(LOCK) "$(MUTMUT)"
	$(PY) tools/mutate.py $(MODULES) $(if $(TESTS),--tests $(TESTS))

clean:
	rm -rf $(VENV) .venv-latest .venv-oldest .venv-wheel build dist src/*.egg-info .pytest_cache \
		js/node_modules js/test/fixture examples/web/node_modules examples/web/fixture examples/web/out \
		bench/js/node_modules bench/js/fixture
