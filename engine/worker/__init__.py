"""The model side on one device: the worker (model, tokenizer, KV cache memory), the model
runner (a scheduled step as one packed forward pass), its step inputs, CUDA graphs, memory
profiling, kernel settings and warm-up, process tuning and a tensor-parallel rank's loop."""
