"""Grafana dashboard, provisioning files and the Prometheus scrape config."""
