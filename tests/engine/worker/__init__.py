"""A step on the device (kvpilot.engine.worker): the sampler, speculative decoding, the KV budget."""
