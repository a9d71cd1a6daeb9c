"""Rollout engines: `hf` (embedded HF decode loop) and, later, `vllm`."""
