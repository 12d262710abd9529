"""The package's layers only look down, and no module imports another that imports it back.

Every import counts, the ones inside functions too: a lazy import is still a dependency, and so is a module
loaded by a literal name (`importlib.import_module("barellm.x")`, `__import__("barellm.x")`). A layer is a
folder of src/barellm (or, at the bottom, the few modules at its top); a module may import modules of its own
layer or below. LAYERS lists the layers, lowest first (a name stands for itself and every module under it).
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
    ["barellm.options"],                               # the command-line options both front ends share
    ["barellm.cli", "barellm.serve"],                  # the front ends: the command line; the server
    ["barellm.__main__"],                              # the barellm command: both front ends' commands
]

LOADERS = {"import_module", "__import__"}   # importlib.import_module, import_module, __import__


def _modules() -> dict[str, Path]:
    mods = {}
    for p in (SRC / "barellm").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _loaded(node: ast.Call, package: list[str]) -> str | None:
    """The module a call `import_module("...")` (through importlib or not) or `__import__("...")` loads, when
    its name is a literal (relative ones against their literal `package`, else the caller's)."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called not in LOADERS or not node.args:
        return None
    arg = node.args[0]
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return None
    target = arg.value
    if target.startswith("."):
        given = [k.value.value for k in node.keywords if k.arg == "package" and isinstance(k.value, ast.Constant)]
        base = str(given[0]).split(".") if given else package
        level = len(target) - len(target.lstrip("."))
        target = ".".join(base[: len(base) - level + 1] + ([target.lstrip(".")] if target.lstrip(".") else []))
    return target


def _imports(name: str, path: Path, mods: dict[str, Path], source: str | None = None) -> set[str]:
    """The barellm modules `name` imports (resolved to modules that exist; `barellm` itself excluded)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Call):
            loaded = _loaded(node, package)
            if loaded is None:
                continue
            targets = [loaded]
        elif isinstance(node, ast.Import):
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
    """Besides the package's __init__ and the barellm command (__main__, the top layer), its top-level modules
    are the foundations, and few."""
    top = sorted(p.stem for p in (SRC / "barellm").glob("*.py"))
    others = [f"barellm.{m}" for m in top if m not in ("__init__", "__main__")]
    assert all(_rank(m) == 0 for m in others), others
    assert len(others) <= 4, top


def test_a_module_loaded_by_a_literal_name_is_an_import():
    """import_module and __import__ calls with a literal name count as imports (relative ones resolved), so a
    front end cannot reach another, or a lower layer a higher one, by naming it in a string."""
    mods = _modules()
    source = """
import importlib
from importlib import import_module

def lazy(name):
    importlib.import_module("barellm.serve")
    import_module("barellm.cli.commands")
    importlib.import_module(".sampling", package="barellm.generate")
    __import__("barellm.api.model")
    importlib.import_module(name)          # not a literal: not seen
    importlib.import_module("json")        # not barellm's
"""
    found = _imports("barellm.cli.probe", SRC / "barellm" / "cli" / "probe.py", mods, source)
    assert found == {"barellm.serve", "barellm.cli.commands", "barellm.generate.sampling", "barellm.api.model"}
    # in the command line, the server is a crossing; in generate/, the front ends and api/ are above it
    assert [t for t in found if _rank(t) == _rank("barellm.cli") and _folder(t) != "barellm.cli"] == ["barellm.serve"]
    found = _imports("barellm.generate.probe", SRC / "barellm" / "generate" / "probe.py", mods, source)
    assert {t for t in found if _rank(t) > _rank("barellm.generate")} == {"barellm.serve", "barellm.cli.commands",
                                                                        "barellm.api.model"}
