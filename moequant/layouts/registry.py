"""The export layouts by name: each layout file registers its class here, and every caller asks here (the
export, the planner's byte account, the precheck, the recipe's `export.format`)."""

from __future__ import annotations

from moequant.layouts.base import Layout
from moequant.registry import Registry
from moequant.targets import get_target

LAYOUTS: Registry = Registry("layout")
# by what a recipe's export.format calls them
RECIPE_LAYOUTS: Registry = Registry("layout", "export layout {name!r} is not supported; accepted: {accepted}.")


def register(layout: type[Layout]) -> type[Layout]:
    """Make `layout` known by its name (and its recipe name): export_checkpoint, the plan and the precheck
    then take it with no other change."""
    RECIPE_LAYOUTS.add(layout, layout.recipe_name or layout.name)
    return LAYOUTS.add(layout, layout.name)


def reader_for(quant_method) -> type[Layout] | None:
    """The layout that reads checkpoints of this quantization_config.quant_method (None: none does)."""
    return next((layout for layout in LAYOUTS.values() if quant_method in layout.quant_methods), None)


def quant_methods() -> list[str]:
    """Every quantization_config.quant_method a registered layout reads."""
    return [m for layout in LAYOUTS.values() for m in layout.quant_methods]


def layout_for(export_format: str) -> type[Layout]:
    """The layout a recipe's `export.format` names (a layout's own name is accepted too)."""
    if isinstance(export_format, str) and export_format in LAYOUTS and export_format not in RECIPE_LAYOUTS:
        return LAYOUTS[export_format]
    return RECIPE_LAYOUTS.find(export_format)


def layout_refusal(layout: str, spec, target: str, adapter, routed: bool = True) -> str | None:
    """Why `layout` cannot write a tensor in `spec` (a routed expert's, or another's) of this model for
    `target`, or `target` cannot read the layout, decided from the format and the architecture alone, so
    before any work (None: it can). The same rules as the layouts' own check() on a finished plan; which
    formats the target serves is the plan's check (moequant.plan)."""
    if layout not in LAYOUTS:
        return f"export layout {layout!r} is not supported; accepted: {', '.join(LAYOUTS)}"
    writer = LAYOUTS[layout]
    why = get_target(target).check(layout=writer)
    if why:
        return why
    why = writer.refuses_model(adapter)
    if why:
        return why
    if not spec.quantized:
        return None
    if writer.routed_only and not routed:
        return f"the {layout} layout quantizes routed experts only, not {spec.key} non-expert tensors"
    what = writer.refuses(spec)
    return f"the {layout} layout holds {what}, not {spec.key}" if what else None
