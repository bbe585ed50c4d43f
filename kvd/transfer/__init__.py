"""The transfer engine: matching requests across daemons and moving their KV over a path."""
