"""Run infrastructure: Ray placement, checkpoints, metrics, saved trajectories."""
