"""What a run leaves: per-request statistics, reports and plots, the live progress, and
the Prometheus exposition."""
