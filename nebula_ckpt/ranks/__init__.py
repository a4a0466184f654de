"""Internal: the rank dimension: coordinators, shard ownership, the shared commit, writer fencing."""
