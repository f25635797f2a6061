"""`kvpilot profile`: the host's facts and the measurements that make its CPU device profile."""
