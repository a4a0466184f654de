#!/usr/bin/env bash
# Create .venv, install what nebula_ckpt needs, build the C++ extension. Idempotent.
# - If the system python3 already imports torch (a CUDA machine), the venv sees that torch.
# - Otherwise torch==2.13.0 is installed (pinned: an unpinned torch would pull a multi-GB CUDA build).
# - If the extension fails to build, the package still installs and runs its pure-PyTorch path.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# pip's noise about missing local mirror folders on some machines is dropped; errors are kept.
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; return "${PIPESTATUS[0]}"; }
VENV=.venv
STAMP=$VENV/.nebula-installed
if [ -f "$STAMP" ] && [ "$STAMP" -nt setup.py ] && [ "$STAMP" -nt scripts/bootstrap.sh ] && [ "$STAMP" -nt nebula_ckpt/_version.py ] && [ -z "$(find csrc -newer "$STAMP" -print -quit)" ]; then
  exit 0
fi
if [ ! -x $VENV/bin/python ]; then
  if $PY -c "import torch" 2>/dev/null; then
    echo "bootstrap: using the torch of $PY ($($PY -c 'import torch; print(torch.__version__)'))"
    $PY -m venv --system-site-packages $VENV
  else
    $PY -m venv $VENV
  fi
fi
VPY=$VENV/bin/python
if ! $VPY -c "import torch" 2>/dev/null; then
  echo "bootstrap: installing torch==2.13.0"
  quiet $VPY -m pip install -q torch==2.13.0
fi
echo "bootstrap: installing dependencies"
quiet $VPY -m pip install -q "numpy" "safetensors>=0.4" "fsspec>=2023.1" "zstandard" "tqdm" "crc32c>=2.3" \
  "psutil" "pytest" "pytest-timeout" "matplotlib" "ninja" "setuptools" "wheel"
# framework wrappers the tests drive for real (accelerate's AcceleratedOptimizer); torch is left as is
# the model-based stateful test (tests/stateful/) drives its random sequences with Hypothesis's rule machines
quiet $VPY -m pip install -q "hypothesis==6.170.15"
# make test runs the suite on up to 4 workers: most tests wait on processes they start (ranks, crashes)
quiet $VPY -m pip install -q "pytest-xdist==3.8.0"
quiet $VPY -m pip install -q "accelerate==1.15.0"
quiet $VPY -m pip install -q "transformers==5.23.0" "tokenizers==0.23.3" "huggingface-hub==2.4.0"
# torchdata's StatefulDataLoader, which nc.LoopState resumes by its own state; torch is pinned so pip never swaps it
quiet $VPY -m pip install -q "torchdata==0.11.0" "torch==$($VPY -c 'import torch; print(torch.__version__.split("+")[0])')"
quiet $VPY -m pip install -q "peft==0.21.2"   # LoRA models in the integration tests; needs only what is above (no other torch)
quiet $VPY -m pip install -q "pytorch-lightning==2.6.6"
DS_BUILD_OPS=0 quiet $VPY -m pip install -q "deepspeed==0.19.8"   # no CUDA ops built: the tests run it on CPU
echo "bootstrap: building the C++ extension (nebula_ckpt._C)"
if ! quiet $VPY -m pip install -q --no-build-isolation --no-deps -e . ; then
  echo "bootstrap: WARNING: the C++ extension failed to build; installing the pure-PyTorch path" >&2
  NEBULA_NO_EXTENSION=1 quiet $VPY -m pip install -q --no-build-isolation --no-deps -e .
fi
$VPY -c "import nebula_ckpt.native as n; print('bootstrap: nebula_ckpt path:', n.describe())"
touch "$STAMP"
