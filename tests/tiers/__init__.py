"""Tiers: the contract suite run against every kind of tier (test_contract.py), the tiers' own tests, the
memory tier (memory/) and its replicas' single-process parts (replicas/)."""
