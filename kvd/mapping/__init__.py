"""The leaf both the daemon and its clients import: mapping pool memory from exported handles.

It depends only on :mod:`protocol` (and torch / cuda-python), never on the daemon's other
packages, so executors can map a pool without importing the daemon.
"""
