"""The router's decisions: which engine, where a prompt is computed, who is admitted."""
