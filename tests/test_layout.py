"""The floor plan: each layer imports only the layers beneath it (README's Layout draws it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import edgeinfer

ROOT = Path(__file__).parents[1]

# Lowest first. A module may import its own floor and those below, never one above.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    (
        "ground: errors, the machine, text and numbers",
        (
            "edgeinfer.errors", "edgeinfer.buildflags", "edgeinfer.files", "edgeinfer.sizes", "edgeinfer.system",
            "edgeinfer.logits", "edgeinfer.sampling", "edgeinfer.sampler", "edgeinfer.kv", "edgeinfer.metrics",
            "edgeinfer.textstream", "edgeinfer.chat", "edgeinfer.pages",
        ),
    ),
    ("models: GGUF files, architectures, the catalog, the reference transformer", ("edgeinfer.models",)),
    ("backends: logit machines with a KV cache", ("edgeinfer.backends",)),
    (
        "the engine: tokenizer, sequences, streams, the decode loop, evaluation",
        (
            "edgeinfer.tokenizer", "edgeinfer.vocabulary", "edgeinfer.sequences", "edgeinfer.speculative",
            "edgeinfer.prompt_cache", "edgeinfer.draft_model",
            "edgeinfer.streams", "edgeinfer.engine", "edgeinfer.evaluate",
        ),
    ),
    ("converters: Hugging Face checkpoints to GGUF", ("edgeinfer.converters",)),
    (
        "the top: routing, benchmarks, assembly, the command line, the chat app, the server",
        (
            "edgeinfer.routing", "edgeinfer.bench", "edgeinfer.assemble", "edgeinfer.cli", "edgeinfer.console",
            "edgeinfer.notes", "edgeinfer.__main__", "edgeinfer.tui", "edgeinfer.serve",
        ),
    ),
]  # fmt: skip


def floor_of(module: str) -> int:
    for level, (_, prefixes) in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module} is on no floor: add it to FLOORS in tests/test_layout.py and README's Layout")


def package_modules() -> dict[str, Path]:
    """Every module of the package, by the name it is imported as, from the checkout's folders."""
    folders = {"edgeinfer": ROOT / "edgeinfer", **{f"edgeinfer.{s}": ROOT / s for s in edgeinfer._SIBLINGS}}
    modules = {}
    for package, folder in folders.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def edgeinfer_imports(path: Path) -> set[str]:
    """The edgeinfer modules a file imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {name for name in found if name.startswith("edgeinfer.")}


MODULES = package_modules()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "edgeinfer"))
def test_a_module_imports_only_its_floor_and_those_below(module):
    own = floor_of(module)
    above = {name: floor_of(name) for name in edgeinfer_imports(MODULES[module]) if floor_of(name) > own}
    assert not above, f"{module} ({FLOORS[own][0]}) imports from a floor above it: {sorted(above)}"


def test_the_package_root_exports_only_what_its_floors_hold():
    # edgeinfer/__init__.py re-exports the public API lazily; every module it names must exist.
    for name, module in edgeinfer._EXPORTS.items():
        assert module in MODULES, f"{name} comes from {module}, which is not a module of the package"
