"""``kv_transfer.backend: object_store``: KV blocks through Ray's object store, as a vLLM
connector (connector.py, whose docstring maps the package). Nothing here is imported
by the router but the directory's handle functions; the connector pulls in torch and
vLLM."""
