"""What a serving target is: an engine that loads moequant's checkpoints, described by what it loads (formats
per routed and non-routed tensor, the unit routed experts share a format in, the layouts it reads, which
modules it fuses) and how it refuses. The formats, the layouts and the planner ask a target these things;
none of them names one. One file per engine beside this one; moequant.targets.registry lists them.

Whether an engine can serve something is one question, `Target.check`: the recipe validator (a layout), the
planner and the precheck (a format, routed or not), the layout export (each tensor's format, the routed
experts' mix) all ask it and nothing else. An engine's file answers it by overriding `check` itself or the
parts it is made of (`refuses`, `refuses_layout`, `refuses_routed_mix`)."""

from __future__ import annotations

# Units routed experts share one format in, finest first: each expert on its own, the experts of one layer per
# projection (GGUF stacks them per projection), all experts of a layer, all routed experts of the model.
UNITS = ("expert", "layer_proj", "layer", "model")

GGML_REFUSAL = "ggml block types are for target llama.cpp (GGUF), not {target}"


class Target:
    name = ""
    granularity = "expert"  # the unit its routed experts share a format in (UNITS)
    container = "safetensors"  # what it reads: safetensors shards, or one "gguf" file
    layouts: tuple[str, ...] = ()  # the export layouts it reads (empty: every layout of its container)
    fuses_projections = False  # q/k/v and gate/up become one module, so each such group needs one format
    expert_format_map = False  # reads each routed expert's format from a per-expert map (moequant's vLLM plugin)
    pack_quantized_top_level = False  # reads compressed-tensors' top-level format as pack-quantized when any
    # group is integer (the checkpoint says so)
    non_expert_choice = True  # a budget may choose each non-expert tensor's format (non_experts.formats)
    routed_formats = ""  # what it serves for routed experts, in words (refusals end with it)

    def check(self, spec=None, *, routed: bool = True, layout=None, routed_mix: dict | None = None) -> str | None:
        """Why this engine cannot serve what it is asked (None: it can), one of:
        `spec`: a tensor in this format (`routed`: a routed expert of a fused-MoE layer, whose kernels are
        narrower than linear ones); `layout`: a checkpoint written in this layout (a moequant.layouts class);
        `routed_mix`: routed expert tensors in these formats ({name: spec}), beyond one format per unit."""
        if layout is not None:
            return self.refuses_layout(layout)
        if routed_mix is not None:
            return self.refuses_routed_mix(routed_mix)
        return self.refuses(spec, routed)

    def refuses(self, spec, routed: bool) -> str | None:
        """Why this engine cannot load a tensor in `spec` (None: it can); `routed`: a routed expert of a
        fused-MoE layer, whose kernels are narrower than linear ones."""
        return GGML_REFUSAL.format(target=self.name) if spec.is_ggml else None

    def refuses_layout(self, layout) -> str | None:
        """Why this engine cannot read a checkpoint written in `layout` (a moequant.layouts class)."""
        shown = layout.recipe_name or layout.name
        if layout.container != self.container:
            return (
                f"target {self.name} loads {self.container} checkpoints and export format {shown} writes "
                f"{layout.container}; set an export.format this target loads"
            )
        if self.layouts and layout.name not in self.layouts:
            return f"target {self.name} reads the {' / '.join(self.layouts)} layout, not {shown}"
        return None

    def units(self, specs, expert_names, notes: list | None = None) -> list[tuple[str, list]]:
        """The units a plan may give routed experts one format in, each with the formats of `specs` it allows
        there (a budget solves each and keeps the better plan); `expert_names`: the on-disk names of the
        routed expert tensors; `notes` takes why a finer unit is not offered."""
        return [(self.granularity, list(specs))]

    def unit_of(self, specs, expert_names) -> str:
        """The unit in which a plan whose routed experts use `specs` must give them one format: the finest of
        `units` that allows every one of them."""
        specs = set(specs)
        allowed = [unit for unit, offered in self.units(specs, expert_names) if specs <= set(offered)]
        return min(allowed, key=UNITS.index) if allowed else self.granularity

    def refuses_routed_mix(self, routed: dict) -> str | None:
        """Why this engine cannot load a checkpoint whose routed expert tensors ({name: spec}) are in these
        formats, beyond one format per unit (None: it can)."""
        return None

    def __str__(self) -> str:
        return self.name
