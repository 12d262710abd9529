"""The package's layers only look down, and no module imports another that imports it back.

Every import counts, the ones inside functions too: a lazy import is still a dependency. A layer is a folder
of src/barellm (or, at the bottom, the few modules at its top); a module may import modules of its own layer
or below. LAYERS lists the layers, lowest first (a name stands for itself and every module under it).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

LAYERS: list[list[str]] = [
    ["barellm.errors", "barellm.files", "barellm.progress", "barellm.cpu", "barellm._native"],   # foundations
    ["barellm.formats"],                               # the weight types' codecs and layouts; GGUF, .blm
    ["barellm.arch", "barellm.text"],                  # model description (config, plan, reference); text
    ["barellm.runtime", "barellm.store", "barellm.generate"],   # the engine; model files on disk; generation
    ["barellm.api"],                                   # Model, load(), OpenAI's requests and answers
    ["barellm.cli"],                                   # the command line
    ["barellm.serve"],                                 # the server (its command takes the command line's options)
]


def _modules() -> dict[str, Path]:
    mods = {}
    for p in (SRC / "barellm").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The barellm modules `name` imports (resolved to modules that exist; `barellm` itself excluded)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != "barellm" and t != name:
                found.add(t)
    return found


def _rank(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if any(name == m or name.startswith(m + ".") for m in layer):
            return i
    raise AssertionError(f"module {name} is in no layer of tests/test_layers.py: place it")


def test_every_module_has_a_layer():
    for name in _modules():
        if name != "barellm":
            _rank(name)


def test_no_module_imports_a_higher_layer():
    mods = _modules()
    upward = []
    for name, path in mods.items():
        if name == "barellm":
            continue
        for target in _imports(name, path, mods):
            if _rank(target) > _rank(name):
                upward.append(f"{name} (layer {_rank(name)}) imports {target} (layer {_rank(target)})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycle():
    mods = _modules()
    graph = {name: _imports(name, path, mods) - {"barellm"} for name, path in mods.items() if name != "barellm"}
    # A package's __init__ and its own submodules belong together: an import between them is not a cycle.
    def related(a: str, b: str) -> bool:
        return a.startswith(b + ".") or b.startswith(a + ".")

    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if related(n, m):
                continue
            if state.get(m) == 1:
                cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "\n".join(cycles)


def _folder(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_the_folders_of_a_layer_stand_apart():
    """Folders side by side in a layer (arch and text; runtime, store and generate) import nothing of each
    other: each rests on the layers below alone."""
    mods = _modules()
    crossing = []
    for name, path in mods.items():
        if name == "barellm" or _rank(name) == 0:
            continue
        for target in _imports(name, path, mods):
            if _rank(target) == _rank(name) and _folder(target) != _folder(name):
                crossing.append(f"{name} imports {target}")
    assert not crossing, "\n".join(sorted(crossing))


def test_the_top_of_the_package_holds_only_the_foundations():
    top = sorted(p.name for p in (SRC / "barellm").glob("*.py"))
    assert len(top) <= 6, top
