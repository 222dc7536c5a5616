"""Kernels under evaluation, not used by the package (see each module)."""
