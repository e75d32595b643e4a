"""The import contract, read from the source (ast), so it holds without importing anything.

- No import cycle at all, counting every import (lazy ones inside functions too).
- Layers: every module belongs to one layer (its longest matching prefix in LAYERS) and imports only
  from its own layer or the layers below it, from the command line down to the formats and errors.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moequant"

# top to bottom; a module may import from its own layer and every layer below
LAYERS = [
    ("moequant.cli", "moequant.__main__", "moequant"),  # the command line and `moequant.load`
    ("moequant.pipeline",),  # apply, pareto, quantize, precheck
    ("moequant.evaluate", "moequant.report"),
    ("moequant.plan",),  # recipe, rules, budget solver, plan I/O
    ("moequant.export", "moequant.llamacpp.evaluate"),  # the export driver (any layout), the GGUF file, its score
    ("moequant.measure", "moequant.zoo.train"),  # calibration, its statistics and probes
    ("moequant.parallel", "moequant.metrics", "moequant.progress", "moequant.vllm_plugin"),
    ("moequant.io", "moequant.arch", "moequant.algorithms", "moequant.zoo"),
    ("moequant.layouts",),  # one file per export layout: what it holds, its packer, its config, its reader
    ("moequant.targets",),  # one file per serving engine: what it loads and how it refuses
    ("moequant.formats",),
    (
        "moequant.errors",
        "moequant.registry",
        "moequant.memory_budget",
        "moequant.timing",
        "moequant.vllm_plugin.names",
        "moequant.llamacpp",
    ),  # one clear sentence; the run's memory budget; stage seconds; the plugin's checkpoint keys; llama.cpp's
    # runner (no imports)
]


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
        graph[module] = {
            t
            for n in nodes
            if isinstance(n, (ast.Import, ast.ImportFrom))
            for t in _targets(module, n, modules, path.name == "__init__.py")
        } - {module}
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


def _layer(module: str) -> int:
    """Index in LAYERS of the module's longest matching prefix (`moequant` itself matches exactly)."""
    best, level = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            match = module == p or (p != "moequant" and module.startswith(p + "."))
            if match and len(p) > best:
                best, level = len(p), i
    assert level is not None, f"{module} is in no layer of LAYERS: place it there"
    return level


def test_the_graph_reader_sees_real_imports():
    graph = _graph(lazy=True)
    assert "moequant.formats.core" in graph["moequant.formats.packing"]  # `from moequant.formats.core import ...`
    assert "moequant.algorithms.gptq_triton" in graph["moequant.algorithms.gptq"]  # `from pkg import submodule`
    assert "moequant.pipeline.quantize" in graph["moequant.pipeline.apply"]  # a lazy import inside a function
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_import_cycle_even_through_lazy_imports():
    assert _cycles(_graph(lazy=True)) == []


def test_no_import_cycle_at_module_level():
    assert _cycles(_graph(lazy=False)) == []


def test_every_module_has_a_layer_and_imports_only_downwards():
    wrong = []
    for module, deps in sorted(_graph(lazy=True).items()):
        wrong += [
            f"{module} (layer {_layer(module)}) imports {d} (layer {_layer(d)})"
            for d in sorted(deps)
            if _layer(d) < _layer(module)
        ]
    assert wrong == []


def test_the_layer_reader_places_modules():
    assert _layer("moequant") == 0 and _layer("moequant.zoo.train") < _layer("moequant.zoo")
    assert _layer("moequant.formats.core") == len(LAYERS) - 2 and _layer("moequant.pipeline.apply") == 1


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
