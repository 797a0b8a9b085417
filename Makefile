# make demo  - set up .venv on first use, then run the whole swarm on this machine
# make test  - set up .venv on first use, then lint the protos and run the tests
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test proto lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvasir demo

test: $(STAMP) lint
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/buf lint

proto: $(STAMP)
	$(PY) tools/gen_proto.py

clean:
	rm -rf $(VENV) .kvasir
