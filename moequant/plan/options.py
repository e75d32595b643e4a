"""A budget's choices: for each group of routed experts the candidate formats that can hold it, with their
bytes and predicted loss (group_options, option_table), and the exact solve over those groups
(solve_groups, with plan.solver's knapsack)."""

from __future__ import annotations

from moequant.errors import UserError
from moequant.plan.context import PlanContext
from moequant.plan.solver import solve_choices


def dedupe_specs(specs) -> list:
    seen, out = set(), []
    for spec in specs:
        if spec.key not in seen:
            seen.add(spec.key)
            out.append(spec)
    return out


def layer_text(group) -> str:
    """Layers of a group of (layer, expert) as compact ranges: '0-3, 7'."""
    layers = sorted({item[0] for item in group})
    runs: list[list[int]] = []
    for L in layers:
        if runs and L == runs[-1][1] + 1:
            runs[-1][1] = L
        else:
            runs.append([L, L])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def group_options(ctx: PlanContext, group, specs, notes: list[str] | None):
    """Per candidate that can hold every tensor of the group: (spec, bytes, loss)."""
    options = []
    for spec in specs:
        try:
            total = sum(ctx.expert_bytes(e, spec) for e in group)
        except UserError as error:
            if notes is not None:  # one note per format: the layers it skips and the first reason
                layers, projs, _ = ctx.unfit.setdefault(spec.key, (set(), set(), str(error).rstrip(".")))
                layers.update(item[0] for item in group)
                projs.update(item[2] for item in group if len(item) == 3)  # (layer, expert, proj) items
            continue
        losses = [ctx.expert_loss(e, spec.key) for e in group]
        loss = None if any(x is None for x in losses) else float(sum(losses))
        options.append((spec, total, loss))
    return options


def option_table(ctx: PlanContext, groups, specs, notes) -> list[list[tuple]]:
    """group_options of every group; a group no candidate can hold is refused."""
    table = []
    for group in groups:
        options = group_options(ctx, group, specs, notes)
        if not options:
            raise UserError(
                f"no candidate format can hold the routed experts of layer(s) {layer_text(group)}; "
                f"accepted: add a format whose group size divides their input dimension (e.g. int8 or fp8)."
            )
        table.append(options)
    return table


def solve_groups(ctx: PlanContext, groups, specs, limit: int, notes, extra=None) -> tuple[dict, int] | None:
    """Budget solve over groups of routed experts that each take one format: (expert -> spec, routed bytes
    of the choice), or None. `extra`: {tensor name: [(spec, bytes, loss)]} of non-expert tensors solved in
    the same budget; their choices are in the assignment under their names (their bytes are not in the
    routed bytes)."""
    table = option_table(ctx, groups, specs, notes)
    extra = extra or {}
    table_all = table + list(extra.values())
    choice = solve_choices(
        [[o[1] for o in opts] for opts in table_all], [[o[2] for o in opts] for opts in table_all], limit, notes
    )
    if choice is None:
        return None
    assignment = {}
    used = 0
    for group, opts, index in zip(groups, table, choice):
        spec, nbytes, _ = opts[index]
        used += nbytes
        for e in group:
            assignment[e] = spec
    for name, opts, index in zip(extra, extra.values(), choice[len(table) :]):
        assignment[name] = opts[index][0]
    return assignment, used
