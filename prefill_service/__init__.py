"""Prefill worker: runs prompts, pushes their KV blocks to the chosen decode worker, returns the
first token (docs/architecture.md)."""
