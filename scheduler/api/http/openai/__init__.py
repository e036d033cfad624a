"""The OpenAI-compatible API (``--openai-port``): its requests, its responses, its routes."""
