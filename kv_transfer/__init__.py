"""Moving paged KV blocks between workers: one interface, several transports (DESIGN.md §6).
Knows blocks and bytes, never models."""
