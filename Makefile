# nebula_ckpt — the two commands a newcomer needs: `make demo` and `make test`.
VPY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: demo demo-wipe test test-fast bench bench-quick install blob-servers clean

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

bench: install
	$(VPY) -m nebula_ckpt.cli bench

bench-quick: install
	$(VPY) -m nebula_ckpt.cli bench --quick --out bench_out/quick

clean:
	rm -rf .venv build *.egg-info nebula_ckpt/*.so bench_out demo_ckpt
