"""What executors and operators use to talk to kvd.

- :func:`open_client` / :class:`AsyncClient`: trio client, many requests in flight.
- :class:`Client`: blocking client with the same API, for executors in plain threads.
- ``kvctl``: the operator CLI (:mod:`clients.kvctl`).
"""

from clients.blocking import Client
from clients.client import AsyncClient, open_client

__all__ = ["AsyncClient", "Client", "open_client"]
