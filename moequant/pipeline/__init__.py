"""The drivers the commands share: apply (calibrate → plan → quantize → export → evaluate → report),
pareto (one calibration, several budgets and targets), the layer-by-layer quantize pass, the
expert-parallel split over torch.distributed, the checks that refuse before any work, the run lock and
the fingerprints that make a finished run resumable."""
