"""A vLLM KV connector that moves a request's KV blocks through Ray's object store."""
