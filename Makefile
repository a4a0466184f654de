# nebula_ckpt — the two commands a newcomer needs: `make demo` and `make test`.
VPY := .venv/bin/python
PYTEST_ARGS ?=
# the linters are pinned: a new release with new rules must not turn CI red by itself
RUFF_VERSION := 0.17.6
MYPY_VERSION := 2.4.1

.PHONY: demo demo-wipe test test-fast soak lint bench bench-deps bench-quick install blob-servers clean peer-test

install:
	bash scripts/bootstrap.sh

blob-servers: install
	bash scripts/install_blob_servers.sh

demo: install
	$(VPY) -m nebula_ckpt.demo

demo-wipe: install
	$(VPY) -m nebula_ckpt.demo --wipe-memory

# the suite on as many workers as cores, at most 4 (its multi-rank tests start 2-4 processes each);
# PYTEST_WORKERS=0 runs it in one process
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
# Byte-code compiled once before the suite: with PYTHONDONTWRITEBYTECODE set (as on CI machines) every
# process the tests start (ranks, crash workers, benchmarks: hundreds) would compile the package from
# source again, ~0.15 s each (multi-rank test files ran a sixth faster with it; the whole suite ~3%).
COMPILE := $(VPY) -m compileall -q -j 0 nebula_ckpt tests benchmarks examples > /dev/null
test: install blob-servers
	$(COMPILE)
	$(VPY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

test-fast: install
	$(COMPILE)
	$(VPY) -m pytest -m "not slow and not blob" $(PYTEST_ARGS)

# the frameworks' own checkpoint tests (Lightning, transformers, DCP, DeepSpeed), each run stock and then
# with nebula_ckpt, compared (tests/peers/README.md says where to fetch them; skipped without them)
PEER_SUITES ?=
PEER_ARGS ?=
# what their test files import beyond ours (Lightning's requirements/pytorch/test.txt), only when they run
PEER_DEPS := "cloudpickle>=1.3,<3.2" "jsonargparse" "tensorboardX" "expecttest" "pytest-rerunfailures==16.1" "scikit-learn>0.22.1,<1.9" "omegaconf"
peer-test: install
	@if [ -n "$(PEER_SUITES)" ] && [ -d "$(PEER_SUITES)" ]; then $(VPY) -m pip install -q $(PEER_DEPS); fi
	$(VPY) tests/peers/run.py "$(PEER_SUITES)" $(if $(PEER_ARGS),-- $(PEER_ARGS))

# the model-based stateful test's long profile (tests/stateful/README.md): MINUTES=N (default 10) or
# EXAMPLES=N sequences per seed, MACHINE=single|ranks|both; NEBULA_STATEFUL_SEED / _BLOB replay a failure
MINUTES ?= 10
EXAMPLES ?=
MACHINE ?= both
soak: install
	$(VPY) tests/stateful/soak.py --minutes $(MINUTES) --machine $(MACHINE) $(if $(EXAMPLES),--examples $(EXAMPLES))

# ruff and mypy with the configuration in pyproject.toml (installed into .venv when missing)
lint: install
	@$(VPY) -c "import importlib.metadata as m, sys; \
	  sys.exit(m.version('ruff') != '$(RUFF_VERSION)' or m.version('mypy') != '$(MYPY_VERSION)')" 2>/dev/null \
	  || $(VPY) -m pip install -q "ruff==$(RUFF_VERSION)" "mypy==$(MYPY_VERSION)"
	$(VPY) -m ruff check --output-format concise nebula_ckpt tests benchmarks
	$(VPY) -m mypy nebula_ckpt benchmarks

# peers only the full benchmark needs; the installed torch is pinned so pip never swaps it
bench-deps: install
	$(VPY) -m pip install -q "torchsnapshot==0.1.0" "torch-checkpointing==0.1.1" "torch==$$($(VPY) -c 'import torch; print(torch.__version__.split("+")[0])')"

# the full harness lives in benchmarks/ (not installed): run it from the checkout
bench: bench-deps
	$(VPY) -m benchmarks.run

bench-quick: install
	$(VPY) -m benchmarks.run --quick --out bench_out/quick

clean:
	rm -rf .venv build *.egg-info nebula_ckpt/*.so bench_out demo_ckpt
