"""What every splitserve package builds on, and nothing else: the strict settings base,
the name-to-class registry behind every extension point, and the lifecycle of the
processes we start (servers, Prometheus, benchmark peers).

Named after the distribution so that it can never be shadowed by, or shadow, another
distribution's top-level package; see ``splitserve.packaging``.
"""
