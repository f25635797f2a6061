"""The gateway: the OpenAI-compatible front door that routes to engines and holds requests while a
service scales from zero."""
