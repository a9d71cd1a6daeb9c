# Fresh machine with only Python: `make run` (install + the CPU recipe that learns), `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
PLUGINS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/*/pyproject.toml))
TINY := .cache/tiny-chars
RECIPE ?= recipes/cpu/next_letter.yaml

.PHONY: install install-test run test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned: a plain `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: $(BIN)/python pyproject.toml $(addsuffix /pyproject.toml,$(PLUGINS))
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q $(TORCH) -e . $(addprefix -e ,$(PLUGINS))
	touch $@

install: $(VENV)/.installed

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q $(TORCH) -e ".[test]"
	touch $@

install-test: $(VENV)/.installed-test

$(TINY)/config.json: | install
	$(BIN)/molt tiny-model $(TINY) --chars

run: install $(TINY)/config.json
	$(BIN)/molt run $(RECIPE)

test: install-test
	$(BIN)/python -m pytest -q

bench: install $(TINY)/config.json
	$(BIN)/python bench/step_breakdown.py

clean:
	rm -rf $(VENV) .cache runs
