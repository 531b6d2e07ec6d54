"""The real SmolLM2-135M behind the worker: coherent, deterministic greedy text."""

from __future__ import annotations

import pytest
from workerutil import generate

pytestmark = [pytest.mark.timeout(600)]


def test_smollm2_knows_the_capital_of_france(start_worker) -> None:
    from servegate.models import cache_dir

    if not (cache_dir() / "smollm2-135m" / "model.safetensors").is_file():
        pytest.skip("smollm2-135m not cached; run `servegate model fetch` first")
    worker = start_worker(["--max-total-tokens", "8192"], model_args=["--model", "smollm2-135m"])
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    first = generate(worker.url, body, timeout=300).json()
    second = generate(worker.url, body, timeout=300).json()
    assert "Paris" in first["text"]
    assert second["output_ids"] == first["output_ids"]
