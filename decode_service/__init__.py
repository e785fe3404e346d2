"""Decode worker: receives KV blocks, runs continuous-batching decode, streams tokens; can prefill
locally for short prompts or when a transfer fails (docs/architecture.md)."""
