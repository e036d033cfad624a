"""The OpenAI Responses API (`/v1/responses`): a translator over the chat path, with a bounded persistent store."""
