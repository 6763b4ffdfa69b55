# Two commands for a newcomer:  `make run` (the main job on the embedded default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.moescope-installed

.PHONY: install run test test-slow bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[test]"
	$(VENV)/bin/python -m models.native.build || echo "moescope: native CPU kernels not built; bf16 runs slowly on the CPU"
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/python -m engine.run

test: install
	$(VENV)/bin/python -m pytest -q

test-slow: install
	$(VENV)/bin/python -m pytest -q -m slow
