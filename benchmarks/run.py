"""``python -m benchmarks.run [options]``: the same as ``nebula-ckpt bench [options]``.

The benchmark itself lives in :mod:`benchmarks`; ``--help`` lists the options.
"""

from __future__ import annotations

import sys

from benchmarks.runner import main

if __name__ == "__main__":
    sys.exit(main())
