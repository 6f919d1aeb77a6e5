"""Benchmarks: scripts run as ``python bench/<name>.py``, each printing a table and saving JSON."""
