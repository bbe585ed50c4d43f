"""Benchmark programs (`kvd bench ...`). Nothing in the daemon imports them."""
