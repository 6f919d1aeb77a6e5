"""Everything that hosts an engine: vLLM's AsyncLLM behind the router's protocol
(``host``, ``protocol``), the model-free synthetic backend, the engine's settings
(``settings``), its metrics and utilization sampler, the model it serves
(``model_source``, ``tiny_model``) and our vLLM extensions (``vllm_plugin``: the CPU
pipeline-parallel repair and the orphan guard).

Imported by the router (the protocol, and the hosts it runs in its own process) and by
the application builder; it imports neither.
"""
