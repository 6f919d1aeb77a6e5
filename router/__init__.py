"""The OpenAI-compatible ingress: validation, tokenization, engine choice, stream relay."""
