"""Client-facing gRPC `Generate` API and OpenAI-compatible HTTP gateway, worker registry and
health, dispatch policy, token streaming (docs/architecture.md)."""
