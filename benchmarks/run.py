"""``python -m benchmarks.run [options]``: the same as ``nebula-ckpt bench [options]``.

The benchmark itself lives in :mod:`nebula_ckpt.bench`; ``--help`` lists the options.
"""

from __future__ import annotations

import sys

from nebula_ckpt.bench.runner import main

if __name__ == "__main__":
    sys.exit(main())
