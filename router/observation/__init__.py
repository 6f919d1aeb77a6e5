"""What the router reports: its Prometheus metrics and a record of the traffic it served."""
