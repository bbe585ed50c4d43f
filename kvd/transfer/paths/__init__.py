"""The data paths of a transfer, one module each, behind one small interface.

A path receives everything it needs in a :class:`Job` (the plan, the pools, what it may call
to move bytes) and reports through :class:`Progress` — every write or copy into gen memory is
announced with ``posted`` before it starts and ``ended`` once it reached a final state
(completed, or aborted and confirmed), which is what the transfer state machine counts to
know when no write can land any more. A path never calls back into the engine.

- :mod:`.local`: ctx and gen pools on one daemon, pool to pool;
- :mod:`.mapped`: the peer's pools are mapped here, regroup straight into them;
- :mod:`.direct`: equal layouts, whole blocks as NIXL writes of merged contiguous runs;
- :mod:`.bounce`: gather into staging, NIXL write into granted receive slots, gen scatters;
- :mod:`.fragment`: no receive slot in time, one NIXL descriptor per fragment.
"""

from kvd.transfer.paths.base import Job, Progress, Sent

__all__ = ["Job", "Progress", "Sent"]
