"""The trainer backend: the driver-side handle, one rank, the objective, log-probs."""
