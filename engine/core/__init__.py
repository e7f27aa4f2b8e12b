"""The engine's core, torch-free: requests and their parameters, the scheduler (continuous
batching with chunked prefill over the paged KV cache), what it hands the model side each
step and what comes back, and the KV state snapshot for the live block map."""
