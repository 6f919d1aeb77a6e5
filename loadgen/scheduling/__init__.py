"""When it is sent: arrival processes, the event loop, and the runner that lays a run's
schedule out and keeps it."""
