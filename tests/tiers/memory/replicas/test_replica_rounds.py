"""When a save's replica round may start on a rank (the rule the replicas' thread waits on).

The round of a save waits for this rank's memory tier to be done with it, and while the training
thread is inside ``save_async`` of a later save (its staging copy and Python run without the
round beside them); it never waits for anything ``save_async`` could wait for. The multi-rank
behaviour of the rounds is in tests/tiers/memory/dist/test_replicas.py.
"""

from __future__ import annotations

from nebula_ckpt.tiers.memory.replicas import SaveRound, round_may_start


def test_waits_for_the_memory_tier() -> None:
    save = SaveRound(handle=object(), submitted=True)
    assert not round_may_start(save, [])
    save.memory_done = True
    assert round_may_start(save, [])


def test_a_save_without_the_memory_tier_starts_once_submitted() -> None:
    save = SaveRound()
    assert not round_may_start(save, [])
    save.submitted = True
    assert round_may_start(save, [])  # it sends nothing, but takes part in the round


def test_waits_while_a_later_save_async_runs() -> None:
    save = SaveRound(handle=object(), submitted=True, memory_done=True)
    staging = SaveRound()  # numbered: save_async has not returned yet
    assert not round_may_start(save, [staging])
    staging.handle = object()  # attached: still inside save_async
    assert not round_may_start(save, [staging])
    staging.submitted = True  # save_async returned (its memory tier may still be writing it)
    assert round_may_start(save, [staging])
    assert round_may_start(save, [staging, SaveRound(submitted=True)])
    assert not round_may_start(save, [staging, SaveRound()])
