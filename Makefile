# make demo  - set up .venv on first use, then run the whole swarm on this machine
# make test  - set up .venv on first use, then lint the protos and run the tests
# make test-fast - the tests without real processes, servers or models (seconds)
# make test-other-cpu - the same with MKL and ATen forced down other kernels (make test runs it)
# make fuzz  - the fuzz tier with FUZZ_EXAMPLES random examples per target (make test runs it short)
# make venv-numpy - the torch-free worker's own venv (.venv-numpy, from packaging/worker; make test uses it)
# make proto - regenerate the Python (kvasir_rpc/_gen) and TypeScript (clients/ts/src/gen) code
# make soak  - 32 worker sessions through one gateway and hub for SOAK_SECONDS (make test runs it short)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TS := clients/ts
NODE_STAMP := $(TS)/node_modules/.installed
# The worker in a web page (clients/web): two JS modules (the page's, and its worker thread's),
# bundled by esbuild from clients/web/src and the Node-free modules of clients/ts/src they import,
# and kernel.wasm beside them (dist/, ignored).
WEB_BUNDLE := clients/web/dist/kvasir-web-worker.js
WEB_SOURCES := $(shell find clients/web/src $(TS)/src/worker $(TS)/src/h2 $(TS)/src/wasm $(TS)/src/webgpu $(TS)/src/gen \
	-name '*.ts') \
	$(TS)/src/wasm/kernel.wasm

.PHONY: demo test test-fast test-other-cpu fuzz soak bench profile profile-decode proto lint venv clean system-deps bench-deps node-deps bytecode

venv: $(STAMP)

# One line before each slow step, and pip's progress bar for the big download (torch).
$(STAMP): pyproject.toml constraints.txt
	@echo "setting up $(VENV) (first run: installs torch and the rest, a few minutes)..."
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[1/3] pip"
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "[2/3] torch 2.13.0 (the largest download)"
	@$(PY) -m pip install --progress-bar on -c constraints.txt torch==2.13.0
	@echo "[3/3] kvasir-rpc and its dependencies (transformers, grpcio, trio, ...)"
	@$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $(STAMP)
	@echo "$(VENV) is ready"

# The worker without torch, installed as a user installs it (pip install packaging/worker, from the
# registry, constraints.txt's versions) into a venv of its own: tests/test_numpy_worker.py runs it
# there, where torch cannot be imported. Its packages are copies of kvasir_rpc and worker: a change
# to them installs it again (only the worker itself: --no-deps).
NUMPY_VENV := .venv-numpy
NUMPY_STAMP := $(NUMPY_VENV)/.installed
NUMPY_SOURCES := $(shell find kvasir_rpc worker -name '*.py' -o -name '*.pyi' -o -name py.typed)
.PHONY: venv-numpy
venv-numpy: $(NUMPY_STAMP)

$(NUMPY_STAMP): packaging/worker/pyproject.toml constraints.txt $(NUMPY_SOURCES)
	@echo "setting up $(NUMPY_VENV): the worker without torch (packaging/worker)..."
	@test -x $(NUMPY_VENV)/bin/python || $(PYTHON) -m venv $(NUMPY_VENV)
	@$(NUMPY_VENV)/bin/python -m pip install --quiet --upgrade pip
	@$(NUMPY_VENV)/bin/python -m pip install --quiet -c constraints.txt ./packaging/worker
	@$(NUMPY_VENV)/bin/python -m pip install --quiet --no-deps --force-reinstall ./packaging/worker
	@rm -rf packaging/worker/build kvasir_worker.egg-info
	@touch $(NUMPY_STAMP)

demo: $(STAMP) bytecode
	$(VENV)/bin/kvasir demo

# The project's modules compiled once (compileall skips what is up to date). Where Python runs
# with PYTHONDONTWRITEBYTECODE (as on these CI machines) no process writes them, and every one
# of the suite's ~1,000 processes compiled them again: ~130 ms of CPU each for the relay and
# worker modules alone. Python reads them, and recompiles in memory any whose source changed.
bytecode: $(STAMP)
	@$(PY) -m compileall -q kvasir kvasir_rpc relay worker backbone ledger tools

# The in-process tier (protocol cores, stores, fuzz) on TEST_PROCS processes at once; then the
# real-process tier one test at a time: its tests time deadlines and heartbeats, and each
# already keeps both cores busy.
TEST_PROCS ?= 2
test: $(STAMP) $(NUMPY_STAMP) system-deps node-deps lint bytecode
	$(PY) -m pytest -q -n $(TEST_PROCS) -m "not integration and not soak" --durations=10
	$(MAKE) --no-print-directory test-other-cpu
	$(PY) -m pytest -q -m "integration or soak" --durations=25

# Protocol cores, stores and in-memory streams only: no process, port, database server or model.
test-fast: $(STAMP) bytecode
	$(PY) -m pytest -q -n $(TEST_PROCS) -m "not integration and not fuzz"

# The in-process tier again with the math libraries forced down other code paths, as another
# CPU would take them: MKL's SSE2-compatible GEMM (MKL_CBWR=COMPATIBLE; it rounds otherwise than
# the AVX2 and AVX-512 kernels) and ATen's scalar kernels (ATEN_CPU_CAPABILITY=default). A test
# that asserts how this machine's BLAS rounds fails here, not on the next machine's CI.
OTHER_CPU_ENV ?= MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default
test-other-cpu: $(STAMP) bytecode
	$(OTHER_CPU_ENV) $(PY) -m pytest -q -n $(TEST_PROCS) -m "not integration and not soak and not fuzz"

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

# Where a remote decode's CPU goes per step, kernel included (Linux perf); see tools/profile_decode.py.
profile-decode: $(STAMP)
	$(PY) tools/profile_decode.py

bench-deps:
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx-light; \
	  else \
	    echo "nginx is missing: run 'sudo apt-get install nginx-light' (or kvasir bench skips the edge path)" >&2; \
	  fi; }

lint: $(STAMP) node-deps
	$(VENV)/bin/buf lint
	$(VENV)/bin/mypy kvasir kvasir_rpc relay worker backbone ledger
	npm run --prefix $(TS) --silent typecheck

# The ledger's tests start a throwaway PostgreSQL cluster (Debian's server binaries); the status
# page's test loads it in headless Chromium (Debian's chromium).
system-deps:
	@missing=""; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || missing="$$missing haproxy"; \
	command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing="$$missing nginx-light"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing" >&2; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "missing Debian packages:$$missing: run 'sudo apt-get install$$missing' (Debian/Ubuntu)" >&2; exit 1; \
	  fi; \
	fi

proto: $(STAMP) node-deps
	$(PY) tools/gen_proto.py
	$(VENV)/bin/buf generate --template buf.gen.yaml

# The TypeScript clients' packages (protoc-gen-es, Connect, tsx for the Node tests), exactly as
# clients/ts/package-lock.json pins them; again only when the lock file changes. No install
# scripts run: the only one (esbuild's, under tsx) checks a binary npm already installed.
node-deps: $(NODE_STAMP) $(WEB_BUNDLE)

$(NODE_STAMP): $(TS)/package-lock.json $(TS)/package.json
	@command -v npm >/dev/null 2>&1 || { \
	  echo "npm is missing: the TypeScript clients (clients/ts) need Node.js 20 or later with npm;" \
	       "install it (e.g. 'sudo apt-get install nodejs npm', or from https://nodejs.org)" >&2; exit 1; }
	@node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 20 ? 0 : 1)' || { \
	  echo "Node.js $$(node --version) is too old: the TypeScript clients need Node.js 20 or later" >&2; exit 1; }
	npm ci --prefix $(TS) --no-audit --no-fund --ignore-scripts
	touch $(NODE_STAMP)

$(WEB_BUNDLE): $(NODE_STAMP) $(WEB_SOURCES)
	npm run --prefix $(TS) --silent build:web

clean:
	rm -rf $(VENV) $(NUMPY_VENV) .kvasir $(TS)/node_modules clients/web/dist
