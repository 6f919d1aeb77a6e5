"""The router's engines: their links, their load and prefix state, and the pool's membership."""
