"""vLLM's benchmark client, as we speak it: its command line, its datasets and its result
file."""
