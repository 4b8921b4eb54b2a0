"""The OpenAI-compatible HTTP API, served beside the Unix socket."""
