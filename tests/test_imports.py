"""The import contract, read from the source (ast), so it holds without importing anything.

- Module-level imports of moequant form no cycle: every module can be imported first.
- Floors, counting every import (lazy ones inside functions too): a module imports only from its own
  floor or below. errors → formats → algorithms / arch / dequant → checkpoint / layers → the rest.
- The orchestration modules still reach each other through lazy imports; that one cycle may shrink, never
  grow or gain members (the architecture issue's pipeline / plan split is what breaks it).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moequant"

FLOORS = [
    ("moequant.errors",),
    ("moequant.formats",),
    ("moequant.algorithms", "moequant.arch", "moequant.io.dequant"),
    ("moequant.io.checkpoint", "moequant.io.layers", "moequant.zoo"),
]
ABOVE_FLOORS = {"moequant.zoo.train"}  # trains the bundled models: uses the data pipeline, like a command
# the lazy-import cycle among the upper modules, as of 2026-12-01 (may only shrink)
KNOWN_CYCLE = {
    "moequant.calib.calibrate", "moequant.evaluate", "moequant.export.layouts", "moequant.export.gguf", "moequant.pipeline.fingerprint",
    "moequant.plan.policy", "moequant.calib.probe", "moequant.plan.recipe", "moequant.calib.stats", "moequant.pipeline.apply", "moequant.pipeline.precheck",
    "moequant.vllm_plugin", "moequant.vllm_plugin.method",
}


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _targets(module: str, node, modules, is_package: bool) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    if node.level:
        base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    subs = {f"{prefix}.{a.name}" for a in node.names if f"{prefix}.{a.name}" in modules}
    if len(subs) == len(node.names):  # `from package import submodule`: the submodule only
        return subs
    return subs | ({prefix} if prefix in modules else set())


def _graph(lazy: bool) -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        nodes = ast.walk(tree) if lazy else _module_level(tree.body)
        graph[module] = {t for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))
                         for t in _targets(module, n, modules, path.name == "__init__.py")} - {module}
    return graph


def _module_level(body):
    for node in body:  # what runs at import: the body, and the branches of top-level if / try
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            yield from _module_level(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                yield from _module_level(handler.body)


def _cycles(graph) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _floor(module: str) -> int | None:
    if module in ABOVE_FLOORS:
        return None
    for level, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    return None


def test_the_graph_reader_sees_real_imports():
    graph = _graph(lazy=True)
    assert "moequant.formats.core" in graph["moequant.formats.packing"]  # `from moequant.formats.core import ...`
    assert "moequant.algorithms.gptq_triton" in graph["moequant.algorithms.gptq"]  # `from pkg import submodule`
    assert "moequant.pipeline.quantize" in graph["moequant.pipeline.apply"]  # a lazy import inside a function
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_import_cycle_at_module_level():
    assert _cycles(_graph(lazy=False)) == []


def test_floors_import_only_downwards():
    wrong = []
    for module, deps in _graph(lazy=True).items():
        floor = _floor(module)
        if floor is None:
            continue
        wrong += [f"{module} (floor {floor}) imports {d} (floor {_floor(d)})" for d in sorted(deps)
                  if _floor(d) is None or _floor(d) > floor]
    assert wrong == []


def test_the_lazy_import_cycle_does_not_grow():
    cycles = _cycles(_graph(lazy=True))
    assert all(c <= KNOWN_CYCLE for c in cycles), [sorted(c - KNOWN_CYCLE) for c in cycles]


# Comparisons of a format's name or key outside moequant/formats/, e.g. `spec.name == "int4"`: 44 on
# 2026-12-01, 9 on 2026-12-02 (a reader of other tools' fp8 / fp4 tensors, three layouts that hold one
# format each, two "bf16" map entries). Code asks the spec instead (`spec.quantized`, `spec.refuses(target)`,
# the registry in moequant.formats); this count may only shrink.
FORMAT_NAME_COMPARISONS = 9


def _format_name_comparisons() -> list[str]:
    from moequant import formats

    names = set(formats.format_names()) | set(formats.all_keys())

    def is_format(node) -> bool:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return bool(items) and all(isinstance(i, ast.Constant) and i.value in names for i in items)

    found = []
    for module, path in sorted(_modules().items()):
        if module.startswith("moequant.formats"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(is_format(x) for x in [node.left, *node.comparators]):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_comparison_reader_sees_format_names():
    from moequant import formats

    assert "int4-g128-sym" in formats.all_keys() and "q4_k" in formats.format_names()
    assert any("layout_refusal" not in f and "'mxfp4'" in f for f in _format_name_comparisons())  # gpt-oss's layout


def test_format_names_are_compared_only_inside_the_formats_package():
    found = _format_name_comparisons()
    assert len(found) <= FORMAT_NAME_COMPARISONS, "\n".join(found)
