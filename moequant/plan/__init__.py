"""From a recipe and statistics to a format for every tensor: the recipe schema (recipe), plan building
(policy) over the planning context and statistics (context), keep / rules (rules), what each serving target
allows (serving), the budget (budget) with its option tables (options) and exact solver (solver), the
frontier of several budgets (frontier), the plan's data (model), plan.json I/O (plan_io), the plan's
summary (summary), and every memory account (memory: from the config alone, which `moequant
inspect` prints through inspect, and of checkpoints on disk, the report's memory section; also the one
byte formatter, format_bytes) — all counting bytes with moequant.formats.nbytes."""
