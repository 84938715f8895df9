"""Attention backends for native kernels (unvalidated on hardware here: see docs/shell.md)."""
