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

## lab: JupyterLab on notebooks/
lab: $(DEPS)
	$(PY) -m jupyter lab notebooks/

## record: CUDA only: re-measure, refresh results/<gpu>/ and the recorded cell outputs
record: $(DEPS)
	$(PY) -m cgutils record
	$(PY) -m cgutils record --check

## check: are the recordings current for the notebooks as they are?
check: $(DEPS)
	$(PY) -m cgutils record --check

clean:
	rm -rf build
