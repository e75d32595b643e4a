"""Calibration: the data (data: bundled specs, local files, offline corpora), the runner that pushes it
through the model layer by layer (calibrate), the statistics schema it writes and its rules — which
Hessian an expert uses, the usage floor (stats) — and the per-format sensitivity probe (probe)."""
