"""The embedded CPU worker: an SGLang-compatible HTTP server over a real model.

Modules (the model itself comes from ``servegate.models``, shared with the vLLM engine):
``scheduler`` (admission, continuous batching, the step loop), ``batch`` (prefill and decode
over the left-padded batch), ``sampling`` (sampling parameters, the token picker),
``kv_budget`` (KV token capacity, prefix cache), ``request`` (one request's live state),
``server`` (FastAPI routes), ``metrics`` (Prometheus, SGLang names), ``faults``
(fault-injection switches), ``spec`` (NGRAM speculative decoding), ``logprobs`` (log-prob
helpers), ``cli`` (``servegate worker``). Nothing heavy is imported here: ``import servegate.worker``
does not load torch.
"""

__all__: list[str] = []
