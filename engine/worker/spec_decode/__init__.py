"""Speculative decoding: proposers of draft tokens (the target model verifies them in the runner's
next step, through the sampler's rejection rule)."""
