"""``python -m nebula_ckpt.cli``: the ``nebula-ckpt`` command."""

import sys

from nebula_ckpt.cli import main

sys.exit(main())
