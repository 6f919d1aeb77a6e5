"""What is sent: the workloads (synthetic, custom, mixed, the study's), the BurstGPT trace
and recorded traffic, each drawn into the request sizes of a run."""
