# CUDA Graph Lab. `make run` and `make test` each create or refresh .venv, so either works alone on a
# fresh machine. On a machine without network (the lent GPU), pass PY=python3 to use an existing
# interpreter that already has the dependencies.
PYTHON ?= python3
VENV   := .venv
VENV_PY := $(VENV)/bin/python
PY     ?= $(VENV_PY)
STAMP  := $(VENV)/.installed-stamp
# Install the venv only when we use it.
DEPS   := $(if $(filter $(VENV_PY),$(PY)),$(STAMP))
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))

.PHONY: run test lab record check venv clean

$(STAMP): pyproject.toml
	test -x $(VENV_PY) || $(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install -q -e '.[dev,notebooks]'
	touch $@

venv: $(STAMP)

## run: execute every notebook headless into build/ (also as HTML, figures in build/figures/), print the speedup table
run: $(DEPS)
	mkdir -p build/notebooks build/html
	$(PY) -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=3600 \
		--output-dir build/notebooks $(NOTEBOOKS)
	$(PY) -m jupyter nbconvert --to html --output-dir build/html build/notebooks/*.ipynb
	@echo "Executed notebooks: build/notebooks/ (HTML: build/html/), figures: build/figures/"
	$(PY) -m cgutils bench --show

## test: unit tests and every notebook under nbmake (GPU tests: `$(PY) -m pytest -m gpu` on a GPU)
test: $(DEPS)
	$(PY) -m pytest

# Jupyter refuses to start as root (containers, CI-like boxes) unless told so; only then is it passed.
# Lazy (=): `id` runs only for `make lab`.
ALLOW_ROOT = $(if $(filter 0,$(shell id -u)),--allow-root)

## lab: JupyterLab on notebooks/ (also as root); Run All works without a GPU (recorded mode)
lab: $(DEPS)
	@echo "With a CUDA GPU the cells run live. Without one, Run All works too: cells that need CUDA show the output recorded on a real GPU, under a banner."
	$(PY) -m jupyter lab $(ALLOW_ROOT) notebooks/

## record: CUDA only: re-measure, refresh results/<gpu>/ and the recorded cell outputs
record: $(DEPS)
	$(PY) -m cgutils record
	$(PY) -m cgutils record --check

## check: are the recordings current for the notebooks as they are?
check: $(DEPS)
	$(PY) -m cgutils record --check

clean:
	rm -rf build
