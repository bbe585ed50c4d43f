"""Benchmark programs (``kvd bench ...``): they print figures; tests never assert timings."""
