"""An external OpenAI-compatible load generator: workloads, arrivals, statistics, reports."""
