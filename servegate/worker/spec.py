"""NGRAM (prompt-lookup) speculative decoding for the embedded worker, one request at a time.

Drafts come from the request's own tokens: the longest recent n-gram that ends the
sequence is looked up earlier in prompt + output, and the tokens that followed it are
proposed. One forward pass over ``[last token, draft_1 .. draft_k]`` verifies them all;
the longest prefix that greedy decoding agrees with is accepted, plus the model's own
next token, and the KV cache is cropped back to what was accepted. Every accepted token
is therefore exactly the greedy token, so with float32 weights the output equals plain
greedy decoding (bfloat16 may differ where two logits nearly tie, because a k-token
forward rounds differently from k one-token forwards).

``accept_length`` follows SGLang: completion tokens / verification passes
(``spec_verify_ct``). The first token comes from the prefill and is counted in the
numerator but is no verification pass, as in SGLang.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import DynamicCache

from servegate.errors import ConfigError, StageError

__all__ = ["FinishReason", "NgramDraftIndex", "SpecResult", "speculative_generate"]

FinishReason = Literal["length", "stop", "abort"]


@dataclass
class SpecResult:
    """What one speculative generation produced."""

    output_ids: list[int]
    """Generated tokens (the matched EOS included when generation stopped on it)."""
    verify_ct: int
    """Verification forward passes (SGLang's ``spec_verify_ct``); the prefill is not one."""
    accept_length: float
    """``len(output_ids) / verify_ct``; NaN when no verification pass ran (e.g. max_new_tokens=1)."""
    finish_reason: FinishReason = "length"
    """``length``: max_new_tokens reached; ``stop``: an EOS token; ``abort``: should_stop said so."""


class NgramDraftIndex:
    """Prompt-lookup drafts over one growing token sequence.

    Keeps, for every n-gram of ``min_ngram..max_ngram`` tokens, the position where its most
    recent earlier occurrence ends, so that a lookup costs ``max_ngram`` dict probes
    instead of a scan. The most recent occurrence is preferred: in text that repeats
    itself it is the best predictor of what comes next.
    """

    def __init__(self, tokens: Iterable[int] = (), *, min_ngram: int = 1, max_ngram: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"n-gram window must satisfy 1 <= min_ngram <= max_ngram, got "
                              f"min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self._tokens: list[int] = []
        # n-gram -> index of its last token, for occurrences that are not the sequence's suffix
        self._last_end: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def append(self, token: int) -> None:
        last = len(self._tokens) - 1
        if last >= 0:
            # The n-grams ending at the old last token stop being the suffix and become searchable;
            # indexing them only now keeps a lookup from matching the suffix with itself.
            for n in range(self.min_ngram, min(self.max_ngram, last + 1) + 1):
                self._last_end[tuple(self._tokens[last - n + 1:last + 1])] = last
        self._tokens.append(int(token))

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def propose(self, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` draft tokens continuing the sequence; ``[]`` when nothing matches."""
        if num_tokens <= 0 or not self._tokens:
            return []
        last = len(self._tokens) - 1
        for n in range(min(self.max_ngram, last + 1), self.min_ngram - 1, -1):
            end = self._last_end.get(tuple(self._tokens[last - n + 1:]))
            if end is None:
                continue
            # Copy what followed the earlier occurrence. When that runs into the present (a loop
            # shorter than the draft), keep copying from the extended sequence: the loop repeats.
            extended = self._tokens[end + 1:]
            while len(extended) < num_tokens:
                extended.append(extended[len(extended) - (last - end)])
            return extended[:num_tokens]
        return []


def _greedy_token(logits: torch.Tensor, prefix: list[int], logits_processor: Any | None) -> int:
    """argmax of one position's logits, after the (transformers-style) logits processor if any."""
    scores = logits.float().unsqueeze(0)
    if logits_processor is not None:
        prefix_ids = torch.tensor([prefix], dtype=torch.long, device=logits.device)
        scores = logits_processor(prefix_ids, scores)
    return int(scores[0].argmax())


def _result(output: list[int], verify_ct: int, finish_reason: FinishReason) -> SpecResult:
    accept_length = len(output) / verify_ct if verify_ct else math.nan
    return SpecResult(output_ids=output, verify_ct=verify_ct, accept_length=accept_length,
                      finish_reason=finish_reason)


def speculative_generate(
    model: Any,
    input_ids: list[int],
    *,
    max_new_tokens: int,
    num_draft_tokens: int,
    eos_token_ids: set[int],
    ignore_eos: bool,
    on_token: Callable[[int], None],
    should_stop: Callable[[], bool] | None = None,
    logits_processor: Any | None = None,
    replace_drafts: Callable[[list[int]], list[int]] | None = None,
    on_verify: Callable[[int], None] | None = None,
) -> SpecResult:
    """Greedy generation with NGRAM speculative decoding for one request.

    ``model`` is a transformers causal LM; ``on_token`` is called once per output token,
    in order, as soon as its verification pass has accepted it. ``should_stop`` is polled
    before every forward pass; when it returns True generation ends with
    ``finish_reason="abort"``. ``logits_processor`` (``(input_ids, scores) -> scores``,
    the transformers convention) is applied to every position before the argmax, with
    the exact prefix that position continues. Up to ``num_draft_tokens`` drafts are
    verified per pass, never more than the token budget can still take.
    ``replace_drafts`` (a fault: ``--fault-random-drafts``) maps the proposed drafts to the
    tokens actually verified, of the same length; the output stays the greedy output whatever
    it returns. ``on_verify`` is called after every verification pass with the number of
    tokens it emitted (accepted drafts + the model's own token), for windowed accept-length
    metrics as SGLang keeps them.
    """
    if not input_ids:
        raise ConfigError("speculative_generate needs a non-empty prompt (input_ids is empty)")
    if num_draft_tokens < 1:
        raise ConfigError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}; "
                          f"set --speculative-num-draft-tokens to a positive integer")
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    tokens = [int(t) for t in input_ids]
    output: list[int] = []
    verify_ct = 0
    if max_new_tokens == 0:
        return _result(output, verify_ct, "length")

    device = model.device
    index = NgramDraftIndex(tokens)
    cache = DynamicCache(config=model.config)

    def accept(token: int) -> bool:
        """Record one token; True when generation must end on it (EOS)."""
        tokens.append(token)
        output.append(token)
        index.append(token)
        on_token(token)
        return not ignore_eos and token in eos_token_ids

    with torch.inference_mode():
        if should_stop is not None and should_stop():
            return _result(output, verify_ct, "abort")
        prompt = torch.tensor([tokens], dtype=torch.long, device=device)
        # logits_to_keep=1: the prompt's other logits would cost prompt_len x vocab floats for nothing.
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        if accept(_greedy_token(logits[0, -1], tokens, logits_processor)):
            return _result(output, verify_ct, "stop")

        while len(output) < max_new_tokens:
            if should_stop is not None and should_stop():
                return _result(output, verify_ct, "abort")
            # A pass yields accepted drafts + one token of its own, so the budget caps drafts at remaining-1.
            drafts = index.propose(min(num_draft_tokens, max_new_tokens - len(output) - 1))
            if replace_drafts is not None and drafts:
                drafts = [int(t) for t in replace_drafts(drafts)][:len(drafts)]
            step = torch.tensor([[tokens[-1], *drafts]], dtype=torch.long, device=device)
            logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits[0]
            verify_ct += 1
            num_fed = step.shape[1]
            num_new = 0
            stopped = False
            for pos in range(num_fed):
                token = _greedy_token(logits[pos], tokens, logits_processor)
                num_new += 1
                if accept(token):
                    stopped = True
                    break
                if pos == len(drafts) or token != drafts[pos]:
                    break
            if on_verify is not None:
                on_verify(num_new)
            if stopped:
                return _result(output, verify_ct, "stop")
            # The cache must hold every token but the newest (which is fed next pass); drop the
            # KV entries of rejected drafts (transformers 5 takes a negative count of tokens to remove).
            cache.crop(-(num_fed - num_new))
            if cache.get_seq_length() != len(tokens) - 1:
                # Guards against a transformers upgrade changing crop's meaning (it did in 5.x).
                raise StageError(f"KV cache holds {cache.get_seq_length()} tokens after cropping, expected "
                                 f"{len(tokens) - 1}; DynamicCache.crop changed behaviour: pin transformers "
                                 f"to the version in pyproject.toml")
    return _result(output, verify_ct, "length")
