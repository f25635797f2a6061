"""Runs a scheduled step on the device: the model runner (inputs, forward, KV tensor) and the sampler."""
