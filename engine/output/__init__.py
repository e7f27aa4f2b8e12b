"""The output side, torch-free: incremental detokenization, stop strings, logprobs and
``RequestOutput`` building. It never calls the scheduler: the requests its stop strings
end are returned to the engine loop, which finishes them."""
