"""Internal: the save path: plan -> buffers -> snapshot -> fan-out -> persist (tier writers, commit)."""
