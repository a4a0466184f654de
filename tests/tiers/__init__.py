"""Tier-level contract tests: one suite, run against every kind of tier."""
