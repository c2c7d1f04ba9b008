"""The HTTP frontend: OpenAI-compatible API, native /generate, request state, metrics."""
