"""kvd: the per-node KV-cache transfer daemon."""
