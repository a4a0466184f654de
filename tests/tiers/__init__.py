"""Tiers: the contract suite run against every kind of tier (test_contract.py), the tiers' own tests, the
memory tier (memory/: every test whose subject is the memory tier, its replicas' single-process parts in
memory/replicas/ and its multi-rank jobs in memory/dist/)."""
