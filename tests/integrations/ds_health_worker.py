"""Phases of a one-rank DeepSpeed job whose loss goes NaN, run as a subprocess by
``test_deepspeed_health.py``; each phase builds its own engine (a restart), closed at its end::

    python ds_health_worker.py ROOT SAVE_DIR OUT.json PHASE...

    train:STEPS:EVERY   STEPS steps, save_checkpoint every EVERY steps, every loss reported
    diverge:TAG         load_checkpoint(SAVE_DIR, tag=TAG; "-": no tag), then the weights go NaN:
                        three steps with a NaN loss, reported (the restored step is marked suspect)
    load:TAG            load_checkpoint(SAVE_DIR) as above
    lost                SAVE_DIR is lost: restore_pointers(SAVE_DIR), then load_checkpoint(SAVE_DIR)

OUT.json: per phase, the step loaded and its restore record, or the error raised.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from ds_worker import init_rank, make_engine, train_step  # noqa: E402


def phase(root: str, save_dir: str, what: str) -> dict[str, Any]:
    from nebula_ckpt.integrations.deepspeed import enable

    name, *args = what.split(":")
    engine = make_engine(0, seed=0)
    ce = enable(engine, root)
    res: dict[str, Any] = {"phase": what}
    try:
        if name == "train":
            for step in range(int(args[0])):
                loss = train_step(engine, step)
                ce.checkpointer.report(engine.global_steps, loss=loss)
                if engine.global_steps % int(args[1]) == 0:
                    engine.save_checkpoint(save_dir)
            return res
        if name == "lost":
            shutil.rmtree(save_dir)
            res["restored_tag"] = ce.restore_pointers(save_dir)
        path, _ = engine.load_checkpoint(save_dir, tag=None if name == "lost" or args[0] == "-" else args[0])
        res.update(path=path, step=engine.global_steps, restore=ce.checkpointer.last_restore)
        if name == "diverge":
            with torch.no_grad():
                next(engine.module.parameters()).fill_(float("nan"))
            for step in range(engine.global_steps, engine.global_steps + 3):
                res["loss"] = train_step(engine, step)
                ce.checkpointer.report(engine.global_steps, loss=res["loss"])
    except Exception as e:  # what the restart is told
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        ce.close()
    return res


def main(root: str, save_dir: str, out: str, *phases: str) -> None:
    init_rank()
    json.dump([phase(root, save_dir, p) for p in phases], open(out, "w"), default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
