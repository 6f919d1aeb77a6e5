"""The router's decisions: which replica, where a prompt is computed, who is admitted."""
