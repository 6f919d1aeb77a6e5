"""Latency profiles: how long an engine step takes on one (device, model, parallel
degree), from a roofline of published specs or fitted from measurements. Shared by the
simulated engines (engines/simulated/) and the load generator, which measures and fits
them (``python -m loadgen profile``)."""
