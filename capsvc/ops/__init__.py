"""What operators run and read: metrics, logs, worker processes."""
