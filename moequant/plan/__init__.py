"""From a recipe and statistics to a format for every tensor: the recipe schema (recipe), the rules and
the budget (policy) with its exact solver (solver), the plan's data (model), plan.json I/O (plan_io), the
plan's summary text (summary), and the memory account `moequant inspect` prints (memory, inspect) — all
counting bytes with moequant.formats.nbytes."""
