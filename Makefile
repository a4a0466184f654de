# nebula_ckpt — the two commands a newcomer needs: `make demo` and `make test`.
VPY := .venv/bin/python
PYTEST_ARGS ?=
# the linters are pinned: a new release with new rules must not turn CI red by itself
RUFF_VERSION := 0.17.6
MYPY_VERSION := 2.4.1

.PHONY: demo demo-wipe test test-fast lint bench bench-deps bench-quick install blob-servers clean

install:
	bash scripts/bootstrap.sh

blob-servers: install
	bash scripts/install_blob_servers.sh

demo: install
	$(VPY) -m nebula_ckpt.demo

demo-wipe: install
	$(VPY) -m nebula_ckpt.demo --wipe-memory

test: install blob-servers
	$(VPY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(VPY) -m pytest -m "not slow and not blob" $(PYTEST_ARGS)

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
