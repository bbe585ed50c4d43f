"""Executor-facing side of the daemon: the Unix listener, peer credentials, fd passing, sessions."""
