"""`cortex serve`: a compiled model behind the Open Inference Protocol (KServe v2) with Prometheus
metrics: the protocol's tensors (codec), a pool of model instances (pool), the app, its metrics
and the uvicorn runner (server)."""
