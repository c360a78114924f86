"""Fused GPU kernels, each beside the plain-jnp reference it is tested against.

Installed as `ultrajax.kernels` (pyproject.toml maps this folder there). Run from the
checkout's root (`python -m ...` puts it first on sys.path) this folder is also found as a
top-level `kernels`, the name of Hugging Face's package that transformers >= 5.25 requires
and imports: that import gets the installed package instead (below), or transformers
fails on import in the conversion commands and their tests.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _here = os.path.realpath(__file__)  # real paths: a linked checkout is this one too
    _root = os.path.dirname(os.path.dirname(_here))
    _elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and os.path.realpath(_spec.origin or "") != _here:
        # the import statement hands back what sys.modules holds once this file has run
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
