"""Simulated engines: vLLM's scheduling (scheduler.py) on a latency profile's time
(splitserve/latency/), hosted behind the router's protocol (host.py)."""
