"""The docs name files that exist: every `ultrajax/...` and `kernels/...` path in README.md,
docs/*.md and benchmarks/RESULTS.md, every `python -m ultrajax.<command>`, and the
README's layout tree, which names every module of the package (README, "Repository
layout").

And every training command on configs/tiny.yaml in the docs parses, and one that changes
anything has a run directory of its own (else it finds the finished tiny run).

Read as text (but those commands, which the config parser reads): a path is found in
backticks, links or prose alike, ends in `.py`, `/` or a folder's name, and is checked
relative to the repository root. A sub-package-relative file (`parallel/tensor.py`,
`cost/steptime.py`) is checked under ultrajax/.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ultrajax.config import parse

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "benchmarks" / "RESULTS.md"]
)
SUBPACKAGES = ("config", "model", "parallel", "data", "train", "cost", "tools")

# Not inside another path (`~/.cache/ultrajax/`, `$OUT/kernels`) or a name (`gpu_kernels/`).
_START = r"(?<![\w./~$-])"
_PATH = re.compile(_START + r"((?:ultrajax|kernels)/[\w./-]*)")
_SHORT = re.compile(_START + r"((?:" + "|".join(SUBPACKAGES) + r")/[\w/]*\w\.py)\b")
_COMMAND = re.compile(r"\bpython3? -m (ultrajax(?:\.\w+)*)(?!\.<)")  # not `ultrajax.<command>`
# `python -m ultrajax.train ...` up to the end of its line, lines ending in `\` joined
_TRAIN = re.compile(r"python3? -m ultrajax\.train((?:\\\n|[^\n`\\]|\\(?!\n))*)")
TINY = "configs/tiny.yaml"


def paths(text: str) -> list[str]:
    """Repository paths named in `text`: `ultrajax/...` and `kernels/...` as written, and
    sub-package-relative files (`model/ops.py`) as the ultrajax/ path they name. Trailing
    sentence punctuation is not part of a path."""
    found = [m.rstrip(".") for m in _PATH.findall(text)]
    found += ["ultrajax/" + m for m in _SHORT.findall(text)]
    return found


def commands(text: str) -> list[str]:
    """The modules of every `python -m ultrajax...` in `text` (a placeholder,
    `python -m ultrajax.<command>`, names none)."""
    return _COMMAND.findall(text)


def runnable(module: str, root: Path = ROOT) -> bool:
    """`python -m module` runs something in this tree: a module with a `__main__` guard,
    or a package with `__main__.py`. `ultrajax.kernels` is the kernels/ folder."""
    parts = module.split(".")[1:]
    base = root / "kernels" if parts[:1] == ["kernels"] else root / "ultrajax"
    parts = parts[1:] if parts[:1] == ["kernels"] else parts
    target = base.joinpath(*parts)
    if (target / "__main__.py").is_file():
        return True
    file = target.with_suffix(".py")
    return bool(parts) and file.is_file() and "__name__ == " in file.read_text()


def layout_tree(readme: str) -> list[str]:
    """The paths of the README's layout tree: the fenced block that holds `ultrajax/`.

    An entry is a line whose names start within the first 20 columns, two spaces of
    indentation a level, separated from its description by two or more spaces; several
    names may share a line (`command.py __main__.py`). A name ending in `/` opens a
    folder for the deeper lines below it. Lines indented 20 or more continue a
    description."""
    section = readme.split("## Repository layout", 1)[1]
    blocks = re.findall(r"^```\n(.*?)^```", section, re.S | re.M)
    (tree,) = [b for b in blocks if re.search(r"^ultrajax/", b, re.M)]
    out, folders = [], []  # folders: (indent, path) of the open folders
    for line in tree.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent >= 20:
            continue
        names = re.split(r"  +", line.strip(), maxsplit=1)[0]
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = folders[-1][1] if folders else ""
        for name in names.split():
            out.append(parent + name)
            if name.endswith("/"):
                folders.append((indent, parent + name))
    return out


def train_commands(text: str) -> list[tuple[list[str], bool]]:
    """(overrides, prints only) of each `python -m ultrajax.train --config
    configs/tiny.yaml ...` in `text`: its key=value arguments, and whether it has
    `--print-config` (which trains nothing)."""
    out = []
    for m in _TRAIN.finditer(text):
        try:
            args = shlex.split(m.group(1).replace("\\\n", " "))
        except ValueError:  # prose around a command, not the command
            continue
        if args[:2] != ["--config", TINY]:
            continue
        out.append(([a for a in args if "=" in a and not a.startswith("-")],
                    "--print-config" in args))  # fmt: skip
    return out


def _missing(found: list[str], root: Path = ROOT) -> list[str]:
    return sorted({p for p in found if not (root / p).exists()})


def _read(doc: Path) -> str:
    return doc.read_text(encoding="utf-8")


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_named_path_exists(doc):
    assert doc.exists()
    missing = _missing(paths(_read(doc)))
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_command_runs_a_module_of_the_tree(doc):
    bad = sorted({m for m in commands(_read(doc)) if not runnable(m)})
    assert not bad, f"{doc.relative_to(ROOT)}: `python -m` of no runnable module: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_tiny_training_commands_parse_and_keep_to_their_own_run(doc):
    """Each command's settings are valid, and one that trains with any setting changed
    names its own `train.run_dir` where its run identity is tiny's: the layout, the
    batch split, the steps and the checkpoints are outside it, so without one such a
    command resumes the tiny run (a finished one trains nothing; another global batch is
    refused)."""
    tiny = parse.default_run_dir(parse.load(TINY), TINY)
    shared = []
    for overrides, prints in train_commands(_read(doc)):
        cfg = parse.load(TINY, overrides)  # a ConfigError names the broken command
        own = any(o.startswith("train.run_dir=") for o in overrides)
        if overrides and not prints and not own and parse.default_run_dir(cfg, TINY) == tiny:
            shared.append(" ".join(overrides))
    assert not shared, f"{doc.relative_to(ROOT)}: commands that would find tiny's run: {shared}"


def test_the_readme_names_the_commands():
    named = set(commands(_read(ROOT / "README.md")))
    for command in ("train", "analyze", "plan", "convert", "generate", "data", "batchfit"):
        assert f"ultrajax.{command}" in named, command


def test_the_layout_tree_matches_the_files():
    """Every entry of the README's tree exists, and every module of the package (but
    `__init__.py`) is an entry: a module added, moved or removed updates the README."""
    tree = layout_tree(_read(ROOT / "README.md"))
    assert "ultrajax/model/attention/backends.py" in tree  # the parser follows the folders
    assert not _missing(tree), f"the README's layout names what does not exist: {_missing(tree)}"
    modules = {
        str(p.relative_to(ROOT))
        for top in ("ultrajax", "kernels")
        for p in (ROOT / top).rglob("*.py")
        if p.name != "__init__.py"
    }
    unnamed = sorted(modules - set(tree))
    assert not unnamed, f"modules missing from the README's layout: {unnamed}"


def test_the_checks_can_fail(tmp_path):
    """Each reader finds what it should on a small text, and a missing file is reported."""
    text = (
        "See `ultrajax/model/ops.py`, [it](ultrajax/parallel/nowhere.py) and kernels/.\n"
        "The rules table is in parallel/mesh.py; data/corpus and train/loss are no files,\n"
        "nor are ~/.cache/ultrajax/cpu_peak.json, $OUT/kernels or gpu_kernels/x.py.\n"
    )
    assert paths(text) == [
        "ultrajax/model/ops.py",
        "ultrajax/parallel/nowhere.py",
        "kernels/",
        "ultrajax/parallel/mesh.py",
    ]
    assert _missing(paths(text)) == ["ultrajax/parallel/nowhere.py"]

    assert commands(
        "`python -m ultrajax.train --config x`, python -m ultrajax.nope, python -m ultrajax.<x>"
    ) == ["ultrajax.train", "ultrajax.nope"]
    assert train_commands(
        "python -m ultrajax.train --config configs/tiny.yaml --cpu-devices 8 \\\n"
        "    mesh.data=2 train.run_dir=runs/x\n"
        "`python -m ultrajax.train --config configs/tiny.yaml --print-config mesh.data=-1`\n"
        "python -m ultrajax.train --config configs/llama-8b.yaml mesh.data=2\n"
    ) == [(["mesh.data=2", "train.run_dir=runs/x"], False), (["mesh.data=-1"], True)]
    (tmp_path / "ultrajax" / "pkg").mkdir(parents=True)
    (tmp_path / "ultrajax" / "pkg" / "__main__.py").write_text("")
    (tmp_path / "ultrajax" / "guarded.py").write_text('if __name__ == "__main__":\n    pass\n')
    (tmp_path / "ultrajax" / "library.py").write_text("X = 1\n")
    assert runnable("ultrajax.pkg", tmp_path)
    assert runnable("ultrajax.guarded", tmp_path)
    assert not runnable("ultrajax.library", tmp_path)  # runs nothing
    assert not runnable("ultrajax.nope", tmp_path)
    assert not runnable("ultrajax", tmp_path)

    readme = (
        "## Repository layout\n\n```\nconfig.schema  <-  model\n```\n\n```\n"
        "ultrajax/\n"
        "  model/            the network\n"
        "    ops.py          weights and\n"
        "                    their gradients\n"
        "    attention/\n"
        "      xla.py        the reference\n"
        "  cli.py            arguments\n"
        "  a.py b.py         two names\n"
        "kernels/           kernels\n"
        "```\n"
    )
    assert layout_tree(readme) == [
        "ultrajax/",
        "ultrajax/model/",
        "ultrajax/model/ops.py",
        "ultrajax/model/attention/",
        "ultrajax/model/attention/xla.py",
        "ultrajax/cli.py",
        "ultrajax/a.py",
        "ultrajax/b.py",
        "kernels/",
    ]
    assert _missing(layout_tree(readme)) == ["ultrajax/a.py", "ultrajax/b.py"]
