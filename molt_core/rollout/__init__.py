"""Rollout: the generator (groups, streaming pool, staleness), the engine client, restarts, eval."""
