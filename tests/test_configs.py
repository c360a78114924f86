"""Every YAML in configs/ parses and validates; the model recipes have the sizes they claim."""

import re
from pathlib import Path

import pytest

from ultrajax.config.parse import load
from ultrajax.config.validate import resolve_mesh
from ultrajax.model.llama import active_param_count, param_count

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))

# file: (devices its comment plans for, published parameter count, tokens per step)
RECIPES = {
    "llama-1b.yaml": (8, 1.24e9, 1_048_576),
    "llama-8b.yaml": (64, 8.03e9, 4_194_304),
    "mixtral-8x7b.yaml": (64, 46.7e9, 4_194_304),
}
ACTIVE = {"mixtral-8x7b.yaml": 12.9e9}  # published parameters per token, an MoE's


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"tiny.yaml", *RECIPES} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates(path):
    cfg = load(path)
    assert cfg.tokens_per_step == cfg.global_batch * cfg.model.seq_len


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_sizes(name):
    devices, params, tokens = RECIPES[name]
    path = CONFIGS[0].parent / name
    cfg = load(path)
    resolve_mesh(cfg, devices)  # the mesh in the file fits the device count it names
    assert abs(param_count(cfg.model) - params) / params < 0.05
    if name in ACTIVE:
        assert abs(active_param_count(cfg.model) - ACTIVE[name]) / ACTIVE[name] < 0.01
    assert cfg.tokens_per_step == tokens
    assert f"{tokens:,} tokens" in path.read_text()  # the comment states the real batch
    assert cfg.model.dtype == "bfloat16"


def test_docs_name_the_tiny_run_directory_it_really_gets():
    """The docs quote configs/tiny.yaml's run directory (a hash of its settings): a changed
    default or recipe must update them, or a reader's paths stop existing."""
    run_dir = load(CONFIGS[0].parent / "tiny.yaml").train.run_dir
    docs = CONFIGS[0].parent.parent / "docs"
    for name in ("first-hour.md", "checkpoints.md"):
        quoted = set(re.findall(r"runs/tiny-[0-9a-f]{6}\b", (docs / name).read_text()))
        assert quoted == {run_dir}, (name, quoted, run_dir)
