"""The rank dimension: coordinators, shard ownership, the shared commit, writer fencing."""
