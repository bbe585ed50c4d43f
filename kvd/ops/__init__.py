"""Operations: structured logs, Prometheus metrics, systemd notification."""
