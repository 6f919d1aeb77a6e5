"""Talking to a server: the streaming HTTP client and its SSE reader, the reading of a
server's metrics (the server view), and the fake server the benches and tests aim at."""
