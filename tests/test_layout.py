"""The package's layout: subpackages that name its parts, and no import circle among its modules.

The import graph is read from the source (every ``import`` statement, also those inside
functions, which run later but still tie the two modules together), so a circle fails here before
it bites as a partly initialised module at run time."""
from __future__ import annotations

import ast
from pathlib import Path

import mps_fused_adam

PACKAGE_DIR = Path(mps_fused_adam.__file__).resolve().parent
NAME = "mps_fused_adam"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join([NAME, *parts])] = path
    return mods


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                # `from pkg import name` imports the submodule pkg.name where there is one, else pkg
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != module}


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_among_the_package_modules():
    graph = import_graph()
    # backends/__init__.py imports .mps inside a function: the graph sees such imports too.
    assert len(graph) > 30 and f"{NAME}.backends.mps" in graph[f"{NAME}.backends"]
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_optimizers_ask_backends_instead_of_knowing_their_classes():
    """No module under optimizers/ imports a backend tier's module (backends.mps) or tests a
    backend's class: they ask ``Backend.unavailable`` (issue 34's one optimizer core)."""
    graph = import_graph()
    for module, imports in graph.items():
        if module.startswith(f"{NAME}.optimizers."):
            assert f"{NAME}.backends.mps" not in imports, module
    for path in (PACKAGE_DIR / "optimizers").glob("*.py"):
        text = path.read_text(encoding="utf-8")
        for cls in ("CPUBackend", "MetalExtBackend", "ShaderLibraryBackend", "ForeachBackend", "TorchFusedBackend"):
            assert cls not in text, (path.name, cls)


def test_subpackages_name_the_architecture():
    top = {p.name for p in PACKAGE_DIR.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {"optimizers", "numerics", "backends", "tools", "deepspeed"} <= top
    flat = sorted(p.stem for p in PACKAGE_DIR.glob("*.py"))
    assert flat == ["__init__", "__main__", "_version", "bench", "bnb_compat", "torchao_compat"], flat


def test_public_names_resolve_to_the_subpackages():
    import mps_fused_adam as mfa
    for name in mfa.__all__:
        assert getattr(mfa, name) is not None
    assert mfa.AdamW.__module__ == f"{NAME}.optimizers.fused"
    assert mfa.AdamW8bit.__module__ == f"{NAME}.optimizers.eight_bit"
    assert mfa.AdamW4bit.__module__ == f"{NAME}.optimizers.four_bit"
