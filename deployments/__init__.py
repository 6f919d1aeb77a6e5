"""Host vLLM engine replicas in Ray Serve and build the application from a validated config."""
