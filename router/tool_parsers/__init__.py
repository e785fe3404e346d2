"""Tool-call parsers: a model's output -> the message's content and its tool calls."""
