"""The Hugging Face Hub as the operator reads it: a model's config.json (hub/client.py). Depends on
api/ only; its one client is built by the operator process and handed to the reconciler."""
