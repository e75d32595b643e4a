"""Measuring the model on the user's data (the `calibrate` stage): its settings (settings), the data
(data: bundled specs of calibration/, local files, offline corpora), the pass that pushes it through the
model layer by layer (calibrate), the statistics schema it writes and its rules — which Hessian an expert
uses, the usage floor (stats) — and the per-layer KL probe (probe)."""
