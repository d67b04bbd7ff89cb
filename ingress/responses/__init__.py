"""OpenAI's Responses API: /v1/responses, its events and its store."""
