"""A child of tests/infra/test_warm_python.py: prints what a fresh interpreter would show it."""

import atexit
import json
import os
import sys
import threading
import time


def _late() -> None:
    time.sleep(0.2)
    print("thread joined", flush=True)


threading.Thread(target=_late).start()
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "probe": os.environ.get("PROBE"),
                  "name": __name__, "file": os.path.basename(__file__),
                  "ours": sorted(m for m in sys.modules if m.startswith(("nebula_ckpt", "warm_python"))),
                  "pythonpath": [p for p in sys.path if p.endswith("probe-extra")],
                  "main_thread_is_the_process": threading.main_thread().native_id == os.getpid()}), flush=True)
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
