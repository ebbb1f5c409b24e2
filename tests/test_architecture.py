"""The layers point one way, and every import says so.

    core ← modelio ← engine ← {proxy, judge, learner} ← nextstate (app wiring, CLI)

A module may import its own package and any layer below it; the three middle packages never
import each other (the app wires them together through objects, not imports). core imports no
torch, transformers or peft, so reading settings or a stored sample stays cheap. Nothing
imports the repository folders by their bare names (`import proxy`): the installed package has
only `nextstate.*`. The check is an AST walk over the source, so lazy imports inside functions
count too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# folder → (subpackage of nextstate, layer); the top package `nextstate` itself is the app.
PACKAGES = {
    "core": ("core", 0),
    "prompts": ("prompts", 0),
    "modelio": ("modelio", 1),
    "engine": ("engine", 2),
    "proxy": ("proxy", 3),
    "judge": ("judge", 3),
    "learner": ("learner", 3),
    "nextstate": ("", 4),
}
HEAVY = ("torch", "transformers", "peft", "safetensors", "tokenizers")
BARE = {"core", "modelio", "engine", "proxy", "judge", "learner", "prompts"}


def source_files(root: Path = ROOT) -> Iterator[tuple[str, Path]]:
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            yield folder, path


def _parse(source: str) -> ast.Module:
    """CPython 3.11's AST builder keeps its depth count per interpreter, not per thread
    (gh-106905): a parse racing another thread's (3.11's traceback module parses to draw its
    carets) raises a spurious SystemError. Parsing again is then correct."""
    try:
        return ast.parse(source)
    except SystemError:
        return ast.parse(source)


def imported_modules(source: str) -> Iterator[tuple[int, str]]:
    for node in ast.walk(_parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:  # `from nextstate import proxy` imports nextstate.proxy
                yield node.lineno, f"{node.module}.{alias.name}"


def _subpackage(module: str) -> str | None:
    """'nextstate.judge.service' → 'judge'; 'nextstate' or 'nextstate.app' → ''."""
    parts = module.split(".")
    if parts[0] != "nextstate":
        return None
    if len(parts) > 1 and parts[1] in {sub for sub, _ in PACKAGES.values() if sub}:
        return parts[1]
    return ""


def violations(files: Iterable[tuple[str, str, str]]) -> list[str]:
    """(folder, file name, source) → every import that breaks the rules, as 'file:line: why'."""
    layer_of = {sub: layer for sub, layer in PACKAGES.values()}
    found: dict[tuple[str, str], str] = {}  # one finding per line and offending package
    for folder, name, source in files:
        own, layer = PACKAGES[folder]
        for line, module in imported_modules(source):
            where = f"{name}:{line}"
            top = module.split(".")[0]
            if top in BARE:
                found.setdefault((where, top), f"{where}: imports '{module}' by its folder name; use nextstate.{module}")
                continue
            if folder == "core" and top in HEAVY:
                found.setdefault((where, top), f"{where}: core imports {top}")
            sub = _subpackage(module)
            if sub is None or sub == own or module in ("nextstate", "nextstate.__version__"):
                continue  # third-party, its own package, or the top package's version
            if layer_of[sub] >= layer:
                message = f"{where}: {own or 'nextstate'} (layer {layer}) imports {module} (layer {layer_of[sub]})"
                found.setdefault((where, sub), message)
    return list(found.values())


def repository_files() -> list[tuple[str, str, str]]:
    return [(folder, str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")) for folder, path in source_files()]


def test_every_import_points_down():
    assert violations(repository_files()) == []


def test_every_package_is_checked():
    """A new top-level package must be given a layer here, or it would escape the check."""
    shipped = {folder for folder in BARE | {"nextstate"} if (ROOT / folder / "__init__.py").is_file()}
    assert shipped == set(PACKAGES)


def test_the_layers_are_the_packages_pyproject_maps():
    """pyproject.toml's package-dir is where the folders are mapped; every layer here is one of them."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        mapped = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    top_folders = {folder.split("/")[0] for folder in mapped.values()}
    assert top_folders == set(PACKAGES)


def test_a_forbidden_import_is_caught():
    planted = [
        ("judge", "judge/planted.py", "from nextstate.proxy.sessions import SessionStore\n"),
        ("learner", "learner/planted.py", "def f():\n    from nextstate.judge import advantages\n"),
        ("learner", "learner/planted2.py", "from nextstate import judge\n"),
        ("core", "core/planted.py", "import torch\nfrom nextstate.engine.base import Engine\n"),
        ("modelio", "modelio/planted.py", "import nextstate.app\n"),
        ("proxy", "proxy/planted.py", "from engine.base import Engine\n"),
    ]
    found = violations(planted)
    assert len(found) == 7, found
    assert all(any(f.startswith(name) for f in found) for _, name, _ in planted)


def test_only_the_stores_package_opens_a_database():
    """Every table has one home (core/stores/): a store elsewhere would bring back a second way
    to open, lock and close a connection."""
    opening = []
    for _, path in source_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "open"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "Database"):
                opening.append(path.relative_to(ROOT).as_posix())
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("open_sqlite", "connect"):
                opening.append(path.relative_to(ROOT).as_posix())
    assert opening and all(p.startswith("core/stores/") for p in opening), sorted(set(opening))
