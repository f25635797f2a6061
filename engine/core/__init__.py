"""The engine's bookkeeping, free of model code: requests, sampling params, KV blocks, scheduling."""
