"""Memory budgets: one typed budget per engine (the flags it takes), and the named memory profiles.

Each engine has its own budget model, told apart by ``engine`` (the discriminator, as guidellm's
BackendArgs ``kind``); the engine class names the one it uses (``Engine.budget_model``). A field
of another engine is an error that lists this engine's fields. The named profiles
(``worker.memory_profile``) are one constant set per hardware profile, shared by every model spec.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MemoryBudget", "SGLangBudget", "VLLMBudget", "EmbeddedBudget", "ExternalBudget", "TransformersBudget",
           "TRANSFORMERS_DEFAULT_BLOCK_SIZE", "EngineBudget", "BUDGET_MODELS", "MemoryProfile", "MEMORY_PROFILES",
           "budget_fields_for"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class MemoryBudget(_Model):
    """How much memory the worker may take: the base of every engine's own budget model.

    ``engine`` says which engine's it is; the engine passes the fields that are set (not None).
    """

    engine: str

    @classmethod
    def field_names(cls) -> list[str]:
        """The budget's fields (without ``engine``), in the order the engine passes them."""
        return [name for name in cls.model_fields if name != "engine"]

    @classmethod
    def lowerable_fields(cls) -> list[str]:
        """The numeric fields: what to lower when the worker is killed for memory (a switch is not a size)."""
        return [name for name in cls.field_names() if cls.model_fields[name].annotation is not bool]

    def settings(self) -> dict[str, Any]:
        """The fields that are set (not None), without ``engine``: what the engine is told."""
        return self.model_dump(exclude_none=True, exclude={"engine"})

    @property
    def token_capacity(self) -> int | None:
        """The KV token capacity this budget sets; None where the engine's budget has none (it sizes itself)."""
        return None


class SGLangBudget(MemoryBudget):
    """SGLang's memory budget; unset fields are not passed (SGLang sizes itself)."""

    engine: Literal["sglang"] = "sglang"
    mem_fraction_static: float | None = Field(None, gt=0, le=1, description="--mem-fraction-static")
    disable_prefill_cuda_graph: bool = Field(
        False, description="--cuda-graph-backend-prefill disabled (when prefill graphs are not needed)")
    max_total_tokens: int | None = Field(None, gt=0, description="KV token capacity (--max-total-tokens)")
    max_running_requests: int | None = Field(None, gt=0, description="--max-running-requests")
    cuda_graph_max_bs: int | None = Field(None, gt=0, description="--cuda-graph-max-bs")

    @property
    def token_capacity(self) -> int | None:
        return self.max_total_tokens


class VLLMBudget(MemoryBudget):
    """vLLM's memory budget; unset fields are not passed (vLLM sizes itself)."""

    engine: Literal["vllm"] = "vllm"
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="--gpu-memory-utilization")
    max_model_len: int | None = Field(None, gt=0, description="--max-model-len")
    max_num_seqs: int | None = Field(None, gt=0, description="--max-num-seqs")
    cpu_kvcache_space_gib: int | None = Field(None, gt=0, description="vLLM CPU: VLLM_CPU_KVCACHE_SPACE (GiB)")


class EmbeddedBudget(MemoryBudget):
    """The embedded CPU worker's memory budget: a KV token capacity and a batch cap (SGLang's flags)."""

    engine: Literal["embedded"] = "embedded"
    max_total_tokens: int | None = Field(None, gt=0, description="KV token capacity (--max-total-tokens)")
    max_running_requests: int | None = Field(None, gt=0, description="--max-running-requests")

    @property
    def token_capacity(self) -> int | None:
        return self.max_total_tokens


class ExternalBudget(MemoryBudget):
    """An attached server (engine external) was started by someone else: servegate budgets nothing."""

    engine: Literal["external"] = "external"


TRANSFORMERS_DEFAULT_BLOCK_SIZE = 256
"""transformers' ``ContinuousBatchingConfig.page_size`` default: the tokens of a block when --cb-block-size is unset."""


class TransformersBudget(MemoryBudget):
    """``transformers serve --continuous-batching``: its paged KV cache and batch size (the ``--cb-*`` flags).

    Unset, transformers sizes the cache from free memory (on CPU 60 % of the host's RAM): set
    ``cb_num_blocks`` to bound it. Its KV token capacity is ``cb_num_blocks`` blocks of
    ``cb_block_size`` tokens (transformers' default page size, 256, when unset).
    """

    engine: Literal["transformers"] = "transformers"
    cb_num_blocks: int | None = Field(None, gt=0, description="KV cache blocks (--cb-num-blocks)")
    cb_block_size: int | None = Field(None, ge=4, description="tokens per KV cache block (--cb-block-size)")
    cb_max_batch_tokens: int | None = Field(None, gt=0, description="tokens per forward batch (--cb-max-batch-tokens)")
    cb_max_memory_percent: float | None = Field(
        None, gt=0, le=1, description="share of free memory for the KV cache when cb_num_blocks is unset "
                                      "(--cb-max-memory-percent)")

    @property
    def token_capacity(self) -> int | None:
        if self.cb_num_blocks is None:
            return None
        return self.cb_num_blocks * (self.cb_block_size or TRANSFORMERS_DEFAULT_BLOCK_SIZE)


EngineBudget = Annotated[SGLangBudget | VLLMBudget | EmbeddedBudget | ExternalBudget | TransformersBudget,
                         Field(discriminator="engine")]
"""One engine's memory budget; ``engine`` says which."""

BUDGET_MODELS: dict[str, type[MemoryBudget]] = {
    model.model_fields["engine"].default: model
    for model in (SGLangBudget, VLLMBudget, EmbeddedBudget, ExternalBudget, TransformersBudget)
}
"""Engine name -> its budget model (each engine class names the same one as ``Engine.budget_model``)."""

# Configs snapshotted before budgets were per engine hold every engine's fields, unset (None, False).
_UNSET_ELSEWHERE = {name: model.model_fields[name].default
                    for model in BUDGET_MODELS.values() for name in model.field_names()}


def budget_fields_for(engine: str, fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` (a ``worker.memory`` mapping) checked against ``engine``'s budget model, with
    ``engine`` filled in; ``ValueError`` naming the fields the engine does not have and listing its own."""
    model = BUDGET_MODELS[engine]
    given = dict(fields)
    if given.setdefault("engine", engine) != engine:
        raise ValueError(f"is a memory budget for engine {given['engine']!r}, but worker.engine is {engine!r}; "
                         f"drop its 'engine' key or give {engine}'s fields: {model.field_names()}")
    own = set(model.model_fields)
    unknown = sorted(k for k in given if k not in own
                     and not (k in _UNSET_ELSEWHERE and given[k] == _UNSET_ELSEWHERE[k]))
    if unknown:
        if not model.field_names():
            raise ValueError(f"engine {engine!r} launches nothing, so it has no memory budget (got {unknown}); "
                             f"remove worker.memory")
        raise ValueError(f"engine {engine!r} has no memory budget field {', '.join(map(repr, unknown))}; "
                         f"its fields: {model.field_names()}")
    return {k: v for k, v in given.items() if k in own}


class MemoryProfile(_Model):
    """One hardware profile's memory budgets, one per engine that runs on that hardware.

    An engine the profile does not name gets its budget's defaults: no flags, the engine sizes itself.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    budgets: dict[str, EngineBudget]

    @classmethod
    def of(cls, *budgets: MemoryBudget) -> "MemoryProfile":
        return cls(budgets={budget.engine: budget for budget in budgets})

    def for_engine(self, engine: str) -> MemoryBudget:
        """``engine``'s budget under this profile (a copy: the profile stays as written)."""
        budget = self.budgets.get(engine)
        return budget.model_copy() if budget is not None else BUDGET_MODELS[engine]()


def _kv_tokens(max_total_tokens: int, max_running_requests: int) -> list[MemoryBudget]:
    """One KV token capacity and batch cap for the embedded worker and SGLang (they spell the flags alike);
    the same capacity for transformers serve, in blocks of its default size, with 1024 tokens per forward
    batch (unset, it sizes the cache from 60 % of the host's free RAM and batches up to 8192 tokens)."""
    return [*(model(max_total_tokens=max_total_tokens, max_running_requests=max_running_requests)
              for model in (EmbeddedBudget, SGLangBudget)),
            TransformersBudget(cb_num_blocks=max_total_tokens // TRANSFORMERS_DEFAULT_BLOCK_SIZE,
                               cb_max_batch_tokens=1024)]


# One named constant set per profile, shared by every model spec (no drift between specs).
MEMORY_PROFILES: dict[str, MemoryProfile] = {
    # 0.6 in CI, per SGLang's router e2e fix.
    "ci-gpu": MemoryProfile.of(
        SGLangBudget(mem_fraction_static=0.6, disable_prefill_cuda_graph=True, cuda_graph_max_bs=32),
        VLLMBudget(gpu_memory_utilization=0.6, max_model_len=4096, max_num_seqs=64)),
    "h100": MemoryProfile.of(
        SGLangBudget(mem_fraction_static=0.85, cuda_graph_max_bs=256),
        VLLMBudget(gpu_memory_utilization=0.9, max_model_len=8192, max_num_seqs=256)),
    # The embedded CPU worker: a KV token capacity and a batch cap.
    "cpu-small": MemoryProfile.of(*_kv_tokens(max_total_tokens=16384, max_running_requests=16)),
    "cpu-large": MemoryProfile.of(*_kv_tokens(max_total_tokens=65536, max_running_requests=32)),
    "vllm-cpu": MemoryProfile.of(VLLMBudget(cpu_kvcache_space_gib=2, max_model_len=2048, max_num_seqs=16)),
}
