"""Settings -> runtime: the one place that knows which runtime each kind of tier has.

The direction is one way: this module imports the settings (:mod:`nebula_ckpt.tiers.base` and
its kinds) and the runtimes; neither imports it. A new tier kind with a runtime of its own is
one entry in :data:`RUNTIMES`.
"""

from __future__ import annotations

from nebula_ckpt.storage.base import Storage
from nebula_ckpt.tiers.base import Tier
from nebula_ckpt.tiers.memory.runtime import MemoryTierRuntime
from nebula_ckpt.tiers.memory.tier import MemoryTier
from nebula_ckpt.tiers.runtime import TierRuntime

#: tier settings class -> its runtime class (the first match along the class's MRO wins);
#: a tier of any other kind gets the plain :class:`TierRuntime`
RUNTIMES: dict[type[Tier], type[TierRuntime]] = {MemoryTier: MemoryTierRuntime}


def runtime_for(tier: Tier, storage: Storage) -> TierRuntime:
    """What ``tier`` does while a Checkpointer runs, over its ``storage`` (owned by the runtime:
    its ``release()`` closes it)."""
    for cls in type(tier).__mro__:
        rt = RUNTIMES.get(cls)
        if rt is not None:
            return rt(tier, storage)
    return TierRuntime(tier, storage)
