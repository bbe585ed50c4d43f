"""Map an attached pool into the executor (re-exported from the shared leaf :mod:`kvd.mapping`)."""

from kvd.mapping.attach import MappedPool, map_pool

__all__ = ["MappedPool", "map_pool"]
