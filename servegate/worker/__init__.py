"""The embedded CPU worker: an SGLang-compatible HTTP server over a real model.

Modules (the model itself comes from ``servegate.models``, shared with the vLLM engine): ``engine`` (continuous batching, prefix cache, KV
budget), ``server`` (FastAPI routes), ``metrics`` (Prometheus, SGLang names),
``faults`` (fault-injection switches), ``spec`` (NGRAM speculative decoding), ``cli``
(``servegate worker``). Nothing heavy is imported here: ``import servegate.worker``
does not load torch.
"""

__all__: list[str] = []
