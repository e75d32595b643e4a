"""What a recipe and the model's shapes decide, checked before any calibration.

Calibration is the slow stage (minutes to hours); everything that does not depend on its
statistics is refused before it starts, in well under a second (safetensors headers and
config.json only, no weights): an unsupported architecture or algorithm, a budget below the
smallest plan the candidates allow, a format that cannot hold a tensor, a format the target
cannot serve, an export layout that cannot carry a format the plan may choose. `apply`,
`pareto`, `plan` and `calibrate --recipe` call `check_recipe` first and write nothing when it
refuses.
"""

from __future__ import annotations

from moequant.errors import UserError


def plan_formats(recipe) -> list:
    """Every format spec the plan may give a routed expert: candidates, the uniform format, rule formats."""
    from moequant.plan.recipe import resolve_format

    entries = [*recipe.experts.formats] if recipe.experts.method == "budget" else []
    if recipe.experts.method == "uniform":
        entries.append(recipe.experts.format)
    if recipe.experts.method == "rules":
        entries += [rule.format for rule in recipe.experts.rules]
    specs = {}
    for entry in entries:
        spec = resolve_format(recipe, entry)
        specs.setdefault(spec.key, spec)
    return list(specs.values())


def check_run(run) -> None:
    """What `apply` refuses before anything is written (a moequant.pipeline.run.Run): the recipe against the
    model's shapes (check_recipe; its notes are logged), a layer that cannot fit the GPU budget or whose read
    cannot fit the host budget, a checkpoint without tokenizer files."""
    for note in check_recipe(run.recipe, run.source, run):
        run.log(f"note: {note}")
    check_memory(run.recipe, run.adapter, run.device)  # before any weight is read
    check_host_memory(run.source, run.device)
    run.source.tokenizer  # noqa: B018  (loaded now and kept: a checkpoint without tokenizer files is refused here)


def check_recipe(recipe, ckpt, run=None) -> list[str]:
    """Raise UserError for what shapes alone refuse in the open checkpoint `ckpt`, and for an algorithm that
    runs in one process only under torchrun; return the plan's notes (e.g. a candidate not offered to some
    layers because it cannot hold their dimensions, and why). The plan of a recipe that reads no statistics
    is made whole here, once: with a `run`, it is kept as `run.plan` for the plan stage."""
    from moequant import parallel
    from moequant.algorithms.registry import algorithm
    from moequant.layouts import layout_for, layout_refusal
    from moequant.plan.policy import check_plan, make_plan, plan_shapes
    from moequant.plan.recipe import resolve_format
    from moequant.plan.rules import needs_statistics
    from moequant.targets import get_target

    adapter = ckpt.adapter
    if recipe.experts.prune is not None and recipe.experts.prune.by == "budget":  # a budget no count can meet
        from moequant.plan.drop import drop_budget, drop_layouts
        from moequant.plan.recipe import Budget

        drop_budget(recipe, ckpt, None, None, drop_layouts(adapter), shapes_only=True)
        # the rest of the shape checks without the byte limit, which dropping may meet where formats alone cannot
        experts = recipe.experts.model_copy(update={"prune": None, "budget": Budget(bits_per_weight=64)})
        recipe = recipe.model_copy(update={"experts": experts})
    elif recipe.experts.prune is not None:  # a count the model cannot drop (moequant.plan.prune), first
        from moequant.plan.prune import prune_layout

        prune_layout(recipe.experts.prune, adapter)
    layout = layout_for(recipe.export.format).name
    specs = plan_formats(recipe)
    for spec in specs:
        if recipe.experts.method == "budget" and get_target(recipe.target).check(spec, routed=True):
            continue  # the plan drops it for the target and says so
        why = layout_refusal(layout, spec, recipe.target, adapter)
        if why:
            raise UserError(
                f"export.format {recipe.export.format}: {why}; drop {spec.key} from the recipe's "
                f"routed-expert formats or choose another export.format."
            )
    non_expert = resolve_format(recipe, recipe.non_experts.format)
    why = layout_refusal(layout, non_expert, recipe.target, adapter, routed=False)
    if why:
        raise UserError(
            f"export.format {recipe.export.format}: {why}; set non_experts.format to one it holds "
            f"(bf16 always works) or choose another export.format."
        )
    if run is not None and not needs_statistics(recipe):
        run.plan = make_plan(recipe, ckpt, None)  # the shapes decide it all: the plan stage takes this one
        notes = list(run.plan.notes)
    else:
        shapes = plan_shapes(recipe, ckpt)
        notes = check_plan(recipe, ckpt, shapes)
        if run is not None:  # the plan stage starts from them (make_plan makes its own for another recipe)
            run.plan_shapes = shapes
    # what the algorithms refuse, for this model and under torchrun (last: the plan's checks say more); an
    # algorithm the recipe names but no format uses is asked about the model alone
    used = {recipe.algorithm_for(spec.name) for spec in specs if spec.quantized}
    for name in dict.fromkeys([*recipe.algorithms.values(), *sorted(used)]):
        refusal = algorithm(name).refusal
        why = refusal(adapter, [], parallel.world_size() if name in used else 1) if refusal is not None else None
        if why:
            raise UserError(why)
    return notes


def unfit_notes(model, format_keys) -> list[str]:
    """One sentence per format that cannot hold some routed-expert projection of `model` (a path or an
    open Checkpoint): calibration measures no sensitivity for it there, and a plan will not offer it to
    those experts."""
    from moequant import formats
    from moequant.io.checkpoint import open_checkpoint

    adapter = open_checkpoint(model).adapter
    refused: dict[tuple, list[str]] = {}  # (projection, group size) -> the formats: one note each, not per format
    for key in format_keys:
        spec = formats.parse_key(key)
        for proj in adapter.projections:
            try:
                formats.check_shape(spec, adapter.expert_shape(proj))
            except UserError:
                refused.setdefault((proj, spec.group_size), []).append(key)
    notes = []
    for (proj, size), keys in refused.items():
        rows, cols = adapter.expert_shape(proj)
        named = f"{keys[0]} cannot" if len(keys) == 1 else f"{', '.join(keys[:-1])} and {keys[-1]} cannot"
        notes.append(
            f"{named} hold the routed experts' {proj} projection ([{rows}, {cols}]: {cols} input columns are not "
            f"a multiple of {'its' if len(keys) == 1 else 'their'} group size {size}); no sensitivity is measured "
            f"for {'it' if len(keys) == 1 else 'them'} there and no plan offers {'it' if len(keys) == 1 else 'them'} there."
        )
    return notes


def layer_gpu_need(recipe, adapter) -> tuple[int, str]:
    """The least GPU memory one MoE layer of the quantize pass needs (bytes), from shapes alone, and
    what it is made of: the layer's experts in bf16 twice (the module the forward runs and the
    quantized copy the next layer reads), its calibration activations, and one expert's statistics
    and GPTQ working set (the smallest chunk moequant.memory_budget can size)."""
    from moequant import parallel

    d, i = adapter.hidden, adapter.expert_intermediate
    e = -(-adapter.num_experts // parallel.world_size())  # this rank's experts under torchrun
    experts = 2 * (2 * e * 3 * d * i)
    c = recipe.calibration
    activations = 4 * c.samples * c.seq_len * d * 2  # layer input and output, the experts' record, a work copy
    one_expert = 4 * (6 * d * d + 8 * i * d) + 2 * 4 * (d * d + 2 * i * i)
    parts = (
        f"its {e} routed experts in bf16 twice {experts / 2**30:.1f} GiB, {c.samples} x {c.seq_len} calibration "
        f"activations {activations / 2**30:.1f} GiB, one expert's Hessians and GPTQ work {one_expert / 2**30:.1f} GiB"
    )
    return experts + activations + one_expert, parts


def check_memory(recipe, adapter, device: str) -> None:
    """Refuse, before any weight is read, a run whose MoE layers cannot fit the GPU budget
    (--max-gpu-memory, else the device's free memory when the device is a GPU)."""
    from moequant import memory_budget

    limit = memory_budget.gpu_limit_bytes()
    if limit is None and not str(device).startswith("cuda"):
        return
    if not adapter.moe_layers:
        return
    need, parts = layer_gpu_need(recipe, adapter)
    if limit is None:
        limit = memory_budget.device_free_bytes(device)
        what = (
            f"the {limit / 2**30:.1f} GiB free on {device} (at most {memory_budget.GPU_DEFAULT_SHARE:.0%} of the card "
            f"without --max-gpu-memory, less a {memory_budget.MARGIN_BYTES / 2**30:.0f} GiB margin)"
        )
    else:
        what = f"--max-gpu-memory {limit / 2**30:.1f} GiB"
    if need > limit:
        raise UserError(
            f"layer {adapter.moe_layers[0]} of {recipe.model} needs at least {need / 2**30:.1f} GiB of GPU "
            f"memory ({parts}), more than {what}; raise --max-gpu-memory, use a larger GPU, or split the "
            f"experts over GPUs with torchrun (expert parallel)."
        )


def layer_host_bytes(ckpt, device: str) -> tuple[int, int]:
    """(decoder layer, bytes) of the layer whose read holds the most host memory at once: on the CPU every
    tensor of the layer as read (a quantized source's weights decoded to float32); on a GPU, where routed
    experts go to the device one stored tensor at a time, the layer's other tensors plus its largest routed
    expert tensor."""
    adapter = ckpt.adapter
    on_gpu = str(device).startswith("cuda")
    best = (0, 0)
    for layer in range(adapter.num_layers):
        rest, expert = 0, 0
        for name in adapter.layer_tensor_names(layer):
            if name not in ckpt.entries:
                continue
            nbytes = ckpt.entries[name].nbytes
            if on_gpu and adapter.classify(name).role == "routed_expert":
                expert = max(expert, nbytes)
            else:
                rest += nbytes
        if rest + expert > best[1]:
            best = (layer, rest + expert)
    return best


def check_host_memory(ckpt, device: str) -> None:
    """Refuse, before any weight is read, a --max-host-memory (or MOEQUANT_MAX_HOST_MEMORY) that cannot hold
    what this process already holds plus one decoder layer's read (`layer_host_bytes`)."""
    from moequant import memory_budget

    cap = memory_budget.host_limit_bytes()
    if cap is None:
        return
    layer, read = layer_host_bytes(ckpt, device)
    held = memory_budget.rss_bytes()
    if held + read > cap:
        raise UserError(
            f"--max-host-memory {_gib(cap)} cannot hold one layer's read: this process already holds {_gib(held)} "
            f"and layer {layer} of {ckpt.path} takes {_gib(read)} as read ({_gib(held + read)} in all); raise "
            f"--max-host-memory to at least {_gib(held + read)}, or leave it out (what is free)."
        )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
