"""No receive slot came in time: the plan's fragments written straight into the peer's pools,
one NIXL descriptor per fragment, never merged (path ``fragment``, a logged fallback)."""

from __future__ import annotations

from kvd.transfer.paths.base import Job, Sent
from kvd.transfer.paths.direct import write_fragments


async def send(job: Job) -> Sent:
    p = job.plan
    sent = await write_fragments(job, {(s, d): p.fragments(s, d) for s, d in p.pairs()})
    return Sent(writes=sent.writes, chunks=sent.chunks, nbytes=sent.nbytes, fallback="fragment")
