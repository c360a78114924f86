"""The package is its layer diagram: imports point down only (README, "Layout").

Read from the source (AST), nothing imported: every module of ultrajax/ and kernels/
(installed as ultrajax.kernels), the ultrajax modules each one imports, where.

  config.schema  <-  kernels  <-  model  <-  parallel  <-  config (parse, validate)
        <-  data, cost  <-  train  <-  tools, cli, the commands

A fact read by the config's validation (attention backends, pipeline schedules, remat
tags) lives in the layer that owns it; validation sits above those layers and reads it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (importer package, packages it must never import, why)
NEVER = [
    ("model", ("parallel", "train", "cost", "tools", "data"), "the model knows no layout"),
    ("parallel", ("train", "cost", "tools", "data"), "placement runs below the trainer"),
    ("cost", ("train", "tools"), "predictions come from the config alone"),
    (
        "kernels",
        ("model", "parallel", "train", "cost", "tools", "data", "config"),
        "kernels sit at the bottom",
    ),
    ("data", ("model", "parallel", "train", "cost", "tools"), "the data pipeline knows no model"),
    (
        "config.schema",
        ("model", "parallel", "train", "cost", "tools", "data", "kernels", "config"),
        "the schema is plain data",
    ),
]
# ultrajax imports allowed inside a function: the module named imports an optional
# third-party package (triton) at its top
LAZY_OK = {("ultrajax.kernels.rms_norm", "ultrajax.kernels.rms_norm_triton")}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "ultrajax").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        parts = ["ultrajax", "kernels", *path.relative_to(ROOT / "kernels").with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, bool, int]]:
    """(ultrajax module imported, inside a function?, line) for every import of `path`."""
    tree = ast.parse(path.read_text())
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner.update(id(n) for n in ast.walk(node) if n is not node)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert not node.level, f"{path}: a relative import"
            # `from pkg import mod` imports the module pkg.mod
            targets = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                for a in node.names
            ]
        else:
            continue
        for t in targets:
            if t.startswith("ultrajax"):
                out.append((t, id(node) in inner, node.lineno))
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _package(module: str) -> str:
    """ultrajax.model.attention.xla -> 'model'; ultrajax.config.schema -> 'config.schema'
    (the schema is a layer of its own); ultrajax.cli and every __main__ -> '' (the
    commands, at the top)."""
    parts = module.split(".")[1:]
    if parts and parts[-1] == "__main__":  # `python -m ultrajax.train`: an entry point
        return ""
    if parts[:2] == ["config", "schema"]:
        return "config.schema"
    return parts[0] if len(parts) > 1 else ""


def test_every_import_resolves_to_a_module():
    missing = sorted(
        f"{name} imports {t}"
        for name, edges in GRAPH.items()
        for t, _, _ in edges
        if t not in MODULES
    )
    assert not missing, missing


def test_no_ultrajax_import_inside_a_function():
    found = sorted(
        f"{MODULES[name].relative_to(ROOT)}:{line} imports {t}"
        for name, edges in GRAPH.items()
        for t, inner, line in edges
        if inner and (name, t) not in LAZY_OK
    )
    assert not found, found


def test_no_import_cycle():
    """Depth-first search over the module graph; a back edge is a cycle."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t, _, _ in GRAPH.get(m, ()):
            if state.get(t) == 1:
                cycle = stack[stack.index(t) :] + [t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t in GRAPH and t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in GRAPH:
        if m not in state:
            visit(m)


@pytest.mark.parametrize("importer, banned, why", NEVER, ids=[n[0] for n in NEVER])
def test_imports_point_down(importer, banned, why):
    bad = sorted(
        f"{name} imports {t}"
        for name, edges in GRAPH.items()
        if _package(name) == importer or (importer == "config" and _package(name) == "config")
        for t, _, _ in edges
        if any(
            _package(t) == b or (b == "config" and _package(t).startswith("config")) for b in banned
        )
    )
    assert not bad, f"{why}: {bad}"


def test_the_checks_can_fail(tmp_path):
    """The graph reader sees an import inside a function and a banned direction."""
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from ultrajax.parallel import mesh\n")
    (edge,) = _imports("ultrajax.model.m", src)
    assert edge == ("ultrajax.parallel.mesh", True, 4)
    assert _package("ultrajax.parallel.mesh") == "parallel"
    assert _package("ultrajax.config.schema") == "config.schema"
    assert _package("ultrajax.train.__main__") == ""


def test_data_preparation_imports_no_jax():
    """`python -m ultrajax.data prepare` spawns worker processes that import
    ultrajax.data.prepare: they must not pay for loading JAX."""
    code = "import sys, ultrajax.data.prepare; print(sorted(m for m in sys.modules if m == 'jax'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_top_level_kernels_import_from_the_checkout_gets_the_installed_package(tmp_path):
    """From the checkout's root (on sys.path under `python -m`) kernels/ is also a top-level
    `kernels`, the name of Hugging Face's package, which transformers >= 5.25 imports: that
    import must get the installed one (it got ours, and every conversion test failed on
    `from kernels import CUDAProperties`), and ultrajax.kernels stays ours."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("INSTALLED = True\n")
    code = (
        f"import sys; sys.path.insert(1, {str(site)!r}); import kernels, ultrajax.kernels as ours; "
        "print(getattr(kernels, 'INSTALLED', False), ours.__file__)"
    )
    root = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-c", code]
    out = subprocess.run(argv, cwd=root, capture_output=True, text=True, check=True)
    installed, ours = out.stdout.split()
    assert installed == "True", out.stdout
    assert Path(ours).resolve() == root / "kernels" / "__init__.py"
    # the checkout on the path a second time, through a link, is the same checkout (it
    # would find itself again, and again)
    (tmp_path / "link").symlink_to(root)
    linked = code.replace(
        f"sys.path.insert(1, {str(site)!r})",
        f"sys.path[1:1] = [{str(tmp_path / 'link')!r}, {str(site)!r}]",
    )
    assert linked != code
    argv = [sys.executable, "-c", linked]
    out = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[0] == "True", out.stderr[-2000:]


SCREEN = 80  # lines: a function reads top to bottom on one screen


def test_no_function_longer_than_a_screen():
    """Long functions become named steps (the pipeline executor, the train loop, the cost
    formulas): a nested function counts inside the one that holds it."""
    long = sorted(
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for path in MODULES.values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > SCREEN
    )
    assert not long, long


def test_modules_stay_small_and_the_package_has_few_top_level_modules():
    """No module over 600 lines; no more than 8 modules directly in ultrajax/ (the config,
    the shared command line and the commands that keep their names)."""
    big = sorted(
        f"{p.relative_to(ROOT)} ({n})"
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > 600
    )
    assert not big, big
    top = sorted(p.name for p in (ROOT / "ultrajax").glob("*.py"))
    assert len(top) <= 8, top
