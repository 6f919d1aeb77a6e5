"""The router's HTTP face: the ingress deployment, request parsing, responses, errors,
API keys and readiness."""
