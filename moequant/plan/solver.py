"""The budget's exact solver: a multiple-choice knapsack over plain lists (per group: the bytes and the
predicted loss of each option), minimising the summed loss under a byte limit met exactly. LP relaxation,
reduced-cost fixing and a dynamic program over the few groups left open; HiGHS' MILP (scipy) only as the
fallback and the tests' reference. The planner (plan.options) builds the groups' options and reads the choice back."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def solve_choices(
    option_bytes: Sequence[Sequence[int]],
    option_loss: Sequence[Sequence[float]],
    limit: int,
    report: list[str] | None = None,
) -> list[int] | None:
    """One option per group, minimising total loss with total bytes <= limit (exactly).

    Returns the chosen option index per group, or None when even the smallest options exceed
    the limit. A multiple-choice knapsack, solved in three exact steps:

    1. LP relaxation: each group's options on their lower convex hull, upgrades taken greedily
       by loss saved per byte; the last upgrade that does not fit sets the multiplier `lam`. The
       same greedy, skipping what does not fit, gives a feasible plan: the upper bound `ub`.
    2. Reduced-cost fixing: with m_g = min_i(loss_gi + lam * bytes_gi) and the reduced cost
       r_gi = loss_gi + lam * bytes_gi - m_g >= 0, every plan x within the limit has
       loss(x) >= sum_g m_g - lam * limit + sum_g r_g,x_g. So a plan better than `ub` uses only
       options with r <= ub - (sum_g m_g - lam * limit): in practice one option in almost every
       group, and a small "core" of groups keeps two or more.
    3. A dynamic program over the core groups on (bytes, loss) states, dropping dominated states
       (no fewer bytes and no less loss) and states whose reduced cost alone exceeds the gap.

    Should the core ever hold more states than MAX_DP_STATES, a HiGHS MILP takes over (its result
    is optimal when HiGHS proves it, and a note in `report` says otherwise).
    """
    n_groups = len(option_bytes)
    if sum(min(b) for b in option_bytes) > limit:
        return None
    fronts = [_pareto_front(b, l) for b, l in zip(option_bytes, option_loss)]
    best = [front[-1] for front in fronts]  # the least-loss option of each group
    if sum(option_bytes[g][best[g]] for g in range(n_groups)) <= limit:
        return best
    lam, greedy = _lp_greedy(fronts, option_bytes, option_loss, limit)
    ub = sum(option_loss[g][greedy[g]] for g in range(n_groups))
    m = [min(option_loss[g][i] + lam * option_bytes[g][i] for i in front) for g, front in enumerate(fronts)]
    lower = sum(m) - lam * limit
    magnitude = abs(sum(m)) + lam * limit + abs(ub)
    gap = ub - lower + 1e-9 * magnitude  # the slack only widens the core: still exact
    allowed = [
        [i for i in front if option_loss[g][i] + lam * option_bytes[g][i] - m[g] <= gap]
        for g, front in enumerate(fronts)
    ]
    choice = _core_dp(allowed, option_bytes, option_loss, m, lam, gap, limit)
    if choice is None:  # too many states: fall back to the MILP
        choice = _milp_choice(fronts, option_bytes, option_loss, limit, report)
        if sum(option_loss[g][choice[g]] for g in range(n_groups)) > ub:
            choice = greedy
    return choice


MAX_DP_STATES = 2_000_000


def _pareto_front(bytes_: Sequence[int], losses: Sequence[float]) -> list[int]:
    """Option indices sorted by bytes, each with strictly less loss than the one before."""
    order = sorted(range(len(bytes_)), key=lambda i: (bytes_[i], losses[i]))
    front: list[int] = []
    for i in order:
        if not front or losses[i] < losses[front[-1]]:
            front.append(i)
    return front


def _lp_greedy(fronts, option_bytes, option_loss, limit) -> tuple[float, list[int]]:
    """(multiplier of the byte limit in the LP relaxation, a feasible greedy choice)."""
    upgrades = []  # (loss saved per byte, group, from, to)
    for g, front in enumerate(fronts):
        hull = [front[0]]
        for i in front[1:]:
            hull.append(i)
            while len(hull) >= 3:  # keep the lower convex hull: efficiencies must decrease
                a, b, c = hull[-3], hull[-2], hull[-1]
                eff_ab = (option_loss[g][a] - option_loss[g][b]) / (option_bytes[g][b] - option_bytes[g][a])
                eff_bc = (option_loss[g][b] - option_loss[g][c]) / (option_bytes[g][c] - option_bytes[g][b])
                if eff_bc >= eff_ab:
                    del hull[-2]
                else:
                    break
        for a, b in zip(hull, hull[1:]):
            eff = (option_loss[g][a] - option_loss[g][b]) / (option_bytes[g][b] - option_bytes[g][a])
            upgrades.append((eff, g, a, b))
    upgrades.sort(key=lambda u: -u[0])
    current = [front[0] for front in fronts]
    spare = limit - sum(option_bytes[g][current[g]] for g in range(len(fronts)))
    lam = None
    blocked: set[int] = set()
    for eff, g, a, b in upgrades:
        if g in blocked:
            continue
        cost = option_bytes[g][b] - option_bytes[g][a]
        if cost <= spare:
            current[g] = b
            spare -= cost
        else:
            if lam is None:
                lam = eff
            blocked.add(g)
    return (lam if lam is not None else 0.0), current


def _core_dp(allowed, option_bytes, option_loss, m, lam, gap, limit) -> list[int] | None:
    """Exact DP over the groups with more than one allowed option (None: too many states)."""
    n_groups = len(allowed)
    choice = [opts[0] if len(opts) == 1 else None for opts in allowed]
    core = [g for g in range(n_groups) if len(allowed[g]) > 1]
    fixed_bytes = sum(option_bytes[g][choice[g]] for g in range(n_groups) if choice[g] is not None)
    fixed_loss = sum(option_loss[g][choice[g]] for g in range(n_groups) if choice[g] is not None)
    fixed_r = sum(
        option_loss[g][choice[g]] + lam * option_bytes[g][choice[g]] - m[g]
        for g in range(n_groups)
        if choice[g] is not None
    )
    min_after = [0] * (len(core) + 1)
    for k in range(len(core) - 1, -1, -1):
        g = core[k]
        min_after[k] = min_after[k + 1] + min(option_bytes[g][i] for i in allowed[g])
    states_bytes = np.array([fixed_bytes], dtype=np.int64)
    states_loss = np.array([fixed_loss], dtype=np.float64)
    states_r = np.array([fixed_r], dtype=np.float64)
    steps = []
    for k, g in enumerate(core):
        opts = allowed[g]
        b = np.array([option_bytes[g][i] for i in opts], dtype=np.int64)
        loss = np.array([option_loss[g][i] for i in opts], dtype=np.float64)
        r = loss + lam * b.astype(np.float64) - m[g]
        new_bytes = (states_bytes[:, None] + b[None, :]).ravel()
        new_loss = (states_loss[:, None] + loss[None, :]).ravel()
        new_r = (states_r[:, None] + r[None, :]).ravel()
        keep = (new_r <= gap) & (new_bytes + min_after[k + 1] <= limit)
        index = np.flatnonzero(keep)
        order = index[np.lexsort((new_loss[index], new_bytes[index]))]
        sorted_loss = new_loss[order]
        running = np.minimum.accumulate(sorted_loss)
        undominated = np.ones(order.size, dtype=bool)
        undominated[1:] = sorted_loss[1:] < running[:-1]
        order = order[undominated]
        if order.size > MAX_DP_STATES:
            return None
        steps.append((order // len(opts), np.array(opts)[order % len(opts)]))
        states_bytes, states_loss, states_r = new_bytes[order], new_loss[order], new_r[order]
    if states_loss.size == 0:
        return None
    state = int(np.argmin(states_loss))
    for k in range(len(core) - 1, -1, -1):
        parent, option = steps[k]
        choice[core[k]] = int(option[state])
        state = int(parent[state])
    return choice


def _milp_choice(fronts, option_bytes, option_loss, limit, report) -> list[int]:
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_array

    n_groups = len(fronts)
    base = [option_bytes[g][front[0]] for g, front in enumerate(fronts)]
    var_group, var_option, var_bytes, var_loss = [], [], [], []
    for g, front in enumerate(fronts):
        for i in front:
            var_group.append(g)
            var_option.append(i)
            var_bytes.append(option_bytes[g][i] - base[g])
            var_loss.append(option_loss[g][i] - option_loss[g][front[0]])
    divisor = math.gcd(*[int(b) for b in var_bytes if b]) or 1
    scaled = np.array(var_bytes, dtype=np.int64) // divisor
    objective = np.array(var_loss, dtype=np.float64)
    objective /= float(np.max(np.abs(objective))) or 1.0
    cap = (limit - sum(base)) // divisor
    n = len(var_group)
    one_hot = csr_array((np.ones(n), (np.array(var_group), np.arange(n))), shape=(n_groups, n))
    for _ in range(8):
        constraints = [
            LinearConstraint(one_hot, 1, 1),
            LinearConstraint(csr_array(scaled.astype(np.float64).reshape(1, -1)), -np.inf, cap),
        ]
        result = milp(
            objective,
            integrality=np.ones(n),
            bounds=Bounds(0, 1),
            constraints=constraints,
            options={"mip_rel_gap": 0.0, "time_limit": 300.0},
        )
        if result.x is None:
            raise RuntimeError(f"the budget solver failed: {result.message}")
        choice = [None] * n_groups
        for j in np.flatnonzero(result.x > 0.5):
            choice[var_group[j]] = var_option[j]
        if any(c is None for c in choice):
            raise RuntimeError("the budget solver returned a solution without one option per group")
        if sum(option_bytes[g][choice[g]] for g in range(n_groups)) <= limit:
            if result.status != 0 and report is not None:
                report.append(
                    f"the budget solver stopped before proving optimality ({result.message}); "
                    f"relative gap {getattr(result, 'mip_gap', float('nan')):.2g}."
                )
            return choice
        cap -= 1  # HiGHS' feasibility tolerance let the byte row overshoot; tighten and resolve
    raise RuntimeError("the budget solver could not meet the byte limit exactly")
