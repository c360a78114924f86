"""Fused GPU kernels, each beside the plain-jnp reference it is tested against.

Installed as `ultrajax.kernels` (pyproject.toml maps this folder there).
"""
