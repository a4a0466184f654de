# nebula_ckpt — the two commands a newcomer needs: `make demo` and `make test`.
VPY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: demo demo-wipe test test-fast bench bench-deps bench-quick install blob-servers clean

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

# peers only the full benchmark needs; the installed torch is pinned so pip never swaps it
bench-deps: install
	$(VPY) -m pip install -q "torchsnapshot==0.1.0" "torch==$$($(VPY) -c 'import torch; print(torch.__version__.split("+")[0])')"

bench: bench-deps
	$(VPY) -m nebula_ckpt.cli bench

bench-quick: install
	$(VPY) -m nebula_ckpt.cli bench --quick --out bench_out/quick

clean:
	rm -rf .venv build *.egg-info nebula_ckpt/*.so bench_out demo_ckpt
