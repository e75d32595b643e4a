"""From a recipe and statistics to a format for every tensor: the recipe schema (recipe), the rules,
the exact budget solver, plan I/O and summaries (policy), and the memory account `moequant inspect`
prints (memory, inspect) — all counting bytes with moequant.formats.nbytes."""
