"""The HTTP doors: one aiohttp app, one package per protocol (openai/)."""
