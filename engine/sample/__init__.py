"""Sampling: the batched sampler, logit processors (penalties, bias, min tokens), draft
verification (rejection sampling) and the n-gram draft proposer."""
