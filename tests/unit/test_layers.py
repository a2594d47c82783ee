"""DESIGN.md's layering, checked on the source: a module imports only from layers below
it (or its own layer, without cycles), fuelspmd imports at the top of the file, transport
plugins import only the seam, and importing fuelspmd loads no optional library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYERS = {
    "errors": 0, "dtypes": 0,
    "backend": 1, "transport": 1,
    "graph": 2,
    "tensor": 3, "autograd": 3, "functional": 3, "compile": 3,
    "comm": 4,
    "topology": 5, "cost": 5, "device_group": 5, "launch": 5, "nn": 5,
    "mesh": 6,
    "tensor_parallel": 7, "pipeline_parallel": 7, "distributed_cache": 7, "optim": 7,
    "checkpoint": 8, "models": 8,
    "cli": 9, "bench": 9, "__main__": 9,
}
PLUGIN_MAY_IMPORT = {"fuelspmd", "fuelspmd.transport", "fuelspmd.errors", "fuelspmd.dtypes",
                     "fuelspmd.backend"}
OPTIONAL = {"mpi4py", "cupy", "cupyx", "torch", "pynvml", "nccl", "ml_dtypes",
            "array_api_strict", "threadpoolctl", "transformers", "matplotlib"}


def _unit(module: str) -> str:
    """The layer-table entry of a dotted fuelspmd module name."""
    return module.split(".")[1]


def _imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """Every absolute or relative import in ``path``, with whether it is at the top level
    (an ``if TYPE_CHECKING:`` block at the top counts as the top)."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    for stmt in tree.body:  # `if TYPE_CHECKING:` imports are for annotations, never run
        if isinstance(stmt, ast.If) and getattr(stmt.test, "id", None) == "TYPE_CHECKING":
            top |= set(map(id, stmt.body))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base]) if base else ".".join(parts)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        found += [(n, id(node) in top) for n in names]
    return found


def _modules(folder: Path, prefix: str) -> dict[str, Path]:
    out = {}
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder).with_suffix("")
        parts = [prefix, *rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def test_every_module_has_a_layer() -> None:
    for module in _modules(ROOT / "fuelspmd", "fuelspmd"):
        if module != "fuelspmd":
            assert _unit(module) in LAYERS, f"{module} is not in DESIGN.md's layer table"


def test_imports_go_down_the_layers_only() -> None:
    modules = _modules(ROOT / "fuelspmd", "fuelspmd")
    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        if module == "fuelspmd":
            continue  # the facade re-exports, lazily, from every layer
        for name, at_top in _imports(path, module):
            if not name.startswith("fuelspmd.") and name != "fuelspmd":
                if not at_top:
                    root = name.split(".")[0]
                    optional = root in OPTIONAL or name == "array_api_compat.cupy"
                    assert optional or root in sys.stdlib_module_names, (
                        f"{module} imports {name} inside a function; only optional packages "
                        f"({sorted(OPTIONAL)}) may be imported where first needed")
                continue
            target = next((m for m in (name, name.rpartition(".")[0]) if m in modules), None)
            if target is None or target == "fuelspmd":
                continue
            assert at_top, f"{module} imports {target} inside a function; move it to the top"
            mine, theirs = LAYERS[_unit(module)], LAYERS[_unit(target)]
            assert theirs <= mine, (f"{module} (layer {mine}) imports {target} "
                                    f"(layer {theirs}); DESIGN.md allows only lower layers")
            if _unit(target) != _unit(module):
                edges.setdefault(_unit(module), set()).add(_unit(target))
    # same-layer imports are allowed between units, but never in a cycle
    def reach(a: str, seen: set[str]) -> set[str]:
        for b in edges.get(a, ()):
            if b not in seen:
                seen.add(b)
                reach(b, seen)
        return seen

    for unit in edges:
        assert unit not in reach(unit, set()), f"import cycle through fuelspmd.{unit}"


def test_transport_plugins_import_only_the_seam() -> None:
    for folder in sorted((ROOT / "transports").iterdir()):
        if not folder.is_dir() or folder.name.startswith((".", "_")):
            continue
        for module, path in _modules(folder, folder.name).items():
            for name, _ in _imports(path, module):
                if name.startswith("fuelspmd.") or name == "fuelspmd":
                    allowed = name in PLUGIN_MAY_IMPORT or name.rpartition(".")[0] in (
                        PLUGIN_MAY_IMPORT - {"fuelspmd"})
                    assert allowed, f"{module} imports {name}; plugins may import only " \
                                    f"{sorted(PLUGIN_MAY_IMPORT - {'fuelspmd'})}"


def test_import_loads_no_optional_library_and_starts_nothing() -> None:
    code = (
        "import sys, threading, pkgutil, importlib, fuelspmd\n"
        "for m in pkgutil.walk_packages(fuelspmd.__path__, 'fuelspmd.'):\n"
        "    if m.name != 'fuelspmd.__main__': importlib.import_module(m.name)\n"
        "bad = sorted({'mpi4py', 'cupy', 'torch', 'matplotlib'} & set(sys.modules))\n"
        "assert not bad, bad\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _module_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the fuelspmd modules it imports, anywhere in the file (``TYPE_CHECKING``
    blocks and function bodies included). ``from P import m`` of a submodule ``P.m`` is an
    edge to ``P.m``, and to the package ``P`` too unless the importer lies inside it (its
    own package is already being initialised then)."""
    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        out = edges.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base]) if base else ".".join(parts)
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                inside = module.startswith(base + ".")
                targets = subs + ([] if subs and inside else [base])
            else:
                continue
            out.update(t for t in targets if t in modules and t != module)
    return edges


def test_no_module_import_cycle_counting_type_checking_imports() -> None:
    """Module by module, no cycle: an annotation-only import is still a dependency a
    reader follows (and a cycle there is one refactor away from an ImportError). The
    facade ``fuelspmd`` (lazy re-exports) is left out."""
    modules = {m: p for m, p in _modules(ROOT / "fuelspmd", "fuelspmd").items()
               if m != "fuelspmd"}
    edges = _module_edges(modules)
    state: dict[str, int] = {}  # 1: on the path, 2: finished
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                cycle = [*path[path.index(n):], n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            visit(m)
