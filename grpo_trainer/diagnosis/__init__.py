"""Training health: what the logged metrics say is going wrong, its likely cause and the fix (docs/HEALTH.md).

`settings` (the thresholds, and the run's settings the messages name), `signals` (the few metrics this adds: missing
rewards, the reward gap of cut completions, the importance weights' effective sample size), `rules` (one pure
function per diagnosis), `monitor` (onset and clearing with hysteresis, the summary) and `logs` (a run directory's
metrics read back, and the plot). Imports nothing else of this package: the trainer feeds it log dicts, and
`grpo-train doctor` feeds it the same dicts read from disk.
"""
