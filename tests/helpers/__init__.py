"""Helpers shared by the test modules (not test modules themselves): the block manager's
fake requests, the kernels' fused-QKV views, tiny models, and a server subprocess."""
