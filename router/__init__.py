"""The OpenAI-compatible ingress: validation, tokenization, replica choice, stream relay."""
