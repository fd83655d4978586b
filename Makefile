# Two entry points for a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.promptfcl-installed

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev,flower,clip,tracking]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m promptfcl run configs/quickstart.yaml

test: $(STAMP)
	$(PY) -m ruff check promptfcl tests benchmarks
	$(PY) -m pytest -q

.PHONY: install demo test
