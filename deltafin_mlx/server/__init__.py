"""`deltafin-run serve` as a library: an OpenAI-compatible server over mlx-lm's,
with every request checked (schema), admitted within the budget (admission),
answered by a handler that watches its client (handler), over a generation loop
that survives a failure and scores prompts between its steps (generation, scoring),
and counted (counters). `app.serve` runs it.
"""
