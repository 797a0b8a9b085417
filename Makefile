# make demo  - set up .venv on first use, then run the whole swarm on this machine
# make test  - set up .venv on first use, then lint the protos and run the tests
# make test-fast - the tests without real processes, servers or models (seconds)
# make fuzz  - the fuzz tier with FUZZ_EXAMPLES random examples per target (make test runs it short)
# make soak  - 32 worker sessions through one gateway and hub for SOAK_SECONDS (make test runs it short)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast fuzz soak bench profile proto lint venv clean system-deps bench-deps

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvasir demo

test: $(STAMP) system-deps lint
	$(PY) -m pytest -q

# Protocol cores, stores and in-memory streams only: no process, port, database server or model.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not integration and not fuzz"

# The fuzz tier, long: random (not derandomized) examples, failures kept in .hypothesis/.
FUZZ_EXAMPLES ?= 5000
fuzz: $(STAMP)
	KVASIR_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -m fuzz --hypothesis-show-statistics

# The soak, long: prints its figures (sessions, tokens, calls, the relays' RSS at start and end).
SOAK_SECONDS ?= 300
soak: $(STAMP)
	KVASIR_SOAK_SECONDS=$(SOAK_SECONDS) $(PY) -m pytest -q -s -m soak tests/test_soak.py

# Benchmarks (not part of the tests): the edge path needs Debian's nginx.
bench: $(STAMP) bench-deps
	$(VENV)/bin/kvasir bench

# Where the relay time goes (py-spy on gateway, hub and worker); see tools/profile_relays.py.
profile: $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt py-spy
	$(PY) tools/profile_relays.py

bench-deps:
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx-light; \
	  else \
	    echo "nginx is missing: run 'sudo apt-get install nginx-light' (or kvasir bench skips the edge path)" >&2; \
	  fi; }

lint: $(STAMP)
	$(VENV)/bin/buf lint
	$(VENV)/bin/mypy kvasir_rpc relay worker backbone ledger

# The ledger's tests start a throwaway PostgreSQL cluster: they need Debian's server binaries.
system-deps:
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql; \
	  else \
	    echo "PostgreSQL server binaries are missing: run 'sudo apt-get install postgresql' (Debian/Ubuntu)" >&2; exit 1; \
	  fi; \
	fi

proto: $(STAMP)
	$(PY) tools/gen_proto.py

clean:
	rm -rf $(VENV) .kvasir
