"""Benchmarks of nebula_ckpt: ``python -m benchmarks.run`` (see README.md)."""
