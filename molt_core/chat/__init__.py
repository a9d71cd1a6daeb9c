"""The loopback OpenAI/Anthropic-compatible chat server that captures the sampled tokens."""
