"""The OpenAI-compatible HTTP server: schemas, errors, routes, the async bridge to the engine, metrics."""
