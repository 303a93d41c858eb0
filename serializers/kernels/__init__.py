"""Triton kernels for the formats (filled in by the kernels work)."""
