"""The engine core shared by prefill and decode workers: models, weight loading, paged KV cache
and block manager, scheduler, sampler, model runner."""
