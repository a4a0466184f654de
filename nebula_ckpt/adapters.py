"""The seam for integration authors: what an adapter of nebula_ckpt to a framework needs beyond
the user API (:data:`nebula_ckpt.__all__`).

The adapters shipped with the package (``nebula_ckpt.integrations``, ``nebula_ckpt.compat``)
import from here, from the user API and from :mod:`nebula_ckpt.errors`, :mod:`nebula_ckpt.tiers`
and :mod:`nebula_ckpt.dcp`, never from internal modules (``tests/api/test_architecture.py`` checks
it). A new adapter should do the same. What is here:

- tags, as frameworks address checkpoints by name: :func:`check_tag` (the rule, with an error
  that names the tag) and :data:`MAX_TAG_CHARS`; steps: :data:`MAX_STEP` (a step is an int in
  ``[0, MAX_STEP]``, what a save takes; a step a framework's pointer file records is read so);
- a root's identity and tier: :func:`canonical_root` (a root's stable identity: real path, or the
  URL without credentials), :func:`refuse_url_credentials` (the check every entry point makes
  first: a password in a URL is refused, credentials go in ``storage_options``),
  :func:`tier_for_root` (the persistent tier a root gets: ``LocalTier`` for a path or
  ``file://``, else ``RemoteTier``);
- :func:`write_file_atomic`: the atomic small-file write the library uses for its markers, for
  a framework's pointer files (a temporary file in the same folder, fsync'd, renamed or linked
  over the path, the folder fsync'd: a crash leaves the old file or the new one);
- the multi-rank protocol a :class:`~nebula_ckpt.Checkpointer` runs over: :class:`Coordinator`
  (its interface), :class:`LocalCoordinator` (one process) and :class:`DistCoordinator`
  (``torch.distributed``, also on a subgroup: ``Checkpointer(..., coordinator=DistCoordinator(group))``).

Example::

    from nebula_ckpt.adapters import canonical_root, check_tag, write_file_atomic

    check_tag("epoch=3-step=1200")  # a ValidationError naming the tag when it is not valid
    write_file_atomic("/ckpt/run-42/latest", b"epoch=3-step=1200")
"""

from __future__ import annotations

from nebula_ckpt.format.checks import MAX_STEP
from nebula_ckpt.format.names import MAX_TAG_CHARS, check_tag
from nebula_ckpt.ranks.coordinator import Coordinator, LocalCoordinator
from nebula_ckpt.ranks.distributed import DistCoordinator
from nebula_ckpt.storage.local import write_file_atomic
from nebula_ckpt.tiers import canonical_root, refuse_url_credentials, tier_for_root

__all__ = [
    "check_tag", "MAX_TAG_CHARS", "MAX_STEP", "canonical_root", "refuse_url_credentials", "tier_for_root",
    "write_file_atomic",
    "Coordinator", "LocalCoordinator", "DistCoordinator",
]
