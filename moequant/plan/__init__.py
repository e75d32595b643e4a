"""From a recipe and statistics to a format for every tensor: the recipe schema (recipe), the rules and
the budget (policy) with its exact solver (solver), the plan's data (model), plan.json I/O (plan_io), the
plan's summary text (summary), and every memory account (memory: from the config alone, which `moequant
inspect` prints through inspect, and of checkpoints on disk, the report's memory section; also the one
byte formatter, format_bytes) — all counting bytes with moequant.formats.nbytes."""
