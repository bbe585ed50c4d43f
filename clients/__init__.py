"""What executors and operators use to talk to kvd.

- :func:`open_client` / :class:`AsyncClient`: trio client, many requests in flight.
- :class:`Client`: blocking client with the same API, for executors in plain threads.
- :class:`PollingClient`: the blocking client plus ``get_finished()``, which returns finished
  requests without blocking (a serving framework's step loop; :mod:`clients.polling`).
- ``kvctl``: the operator CLI (:mod:`clients.kvctl`).
"""

from clients.blocking import Client
from clients.client import AsyncClient, open_client
from clients.polling import PollingClient

__all__ = ["AsyncClient", "Client", "PollingClient", "open_client"]
