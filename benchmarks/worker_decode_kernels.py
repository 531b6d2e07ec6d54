"""The embedded worker's model with transformers' default CPU kernels and with its fast path, side by side.

Loads the model twice in one process (``servegate.models.load_model``, as the worker does), applies
``servegate.worker.fastpath.speed_up`` to the second copy, and alternates them round by round
(A B B A ..., so a drift of the machine's load favours neither): per round and batch size, a
prefill of ``--prompt-len`` random tokens per row (row 0 left-padded by a quarter when batched,
as the worker pads) and ``--steps`` greedy decode steps through a ``DynamicCache``. Prints per
batch size the median decode step and prefill of each, and fast / default; also how many
greedy tokens of the first round agree (random-token prompts make near-ties common, so a bfloat16
kernel that rounds differently may pick another token from there on: this is not an error, the
quality stage's teacher-forced log-prob check is the correctness test).

    python benchmarks/worker_decode_kernels.py
    python benchmarks/worker_decode_kernels.py --batch 1 8 --rounds 4 --steps 48 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import DynamicCache

from servegate.models import ensure_model, load_model
from servegate.worker.fastpath import speed_up


def one_round(model: torch.nn.Module, batch: int, prompt_len: int, steps: int, seed: int) -> tuple[float, float, list]:
    """(median decode step s, prefill s, greedy tokens of row 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 40000, (batch, prompt_len), generator=g)
    mask = torch.ones(batch, prompt_len, dtype=torch.long)
    pos = torch.arange(prompt_len)[None].repeat(batch, 1)
    if batch > 1:
        pad = prompt_len // 4
        mask[0, :pad] = 0
        pos[0] = (torch.arange(prompt_len) - pad).clamp(min=0)
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    prefill = time.perf_counter() - t0
    last = out.logits[:, -1].float().argmax(-1)
    p = pos[:, -1] + 1
    times, tokens = [], [int(last[0])]
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], 1)
        t = time.perf_counter()
        out = model(input_ids=last[:, None], attention_mask=mask, position_ids=p[:, None], past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        last = out.logits[:, -1].float().argmax(-1)
        times.append(time.perf_counter() - t)
        tokens.append(int(last[0]))
        p = p + 1
    return statistics.median(times[min(4, steps - 1):]), prefill, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the worker's default here: 1)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    path = ensure_model(args.model)
    default, _ = load_model(path, args.dtype)
    fast, _ = load_model(path, args.dtype)
    print(f"fast path: {'; '.join(speed_up(fast)) or 'nothing applies'}")
    print(f"{args.model} {args.dtype}, {args.threads} thread(s), prompt {args.prompt_len}, {args.steps} steps, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'batch':>5} {'default step ms':>16} {'fast step ms':>13} {'fast/default':>13} "
          f"{'default prefill ms':>19} {'fast prefill ms':>16} {'same tokens':>12}")
    with torch.inference_mode():
        for batch in args.batch:
            res: dict[str, list[tuple[float, float, list]]] = {"default": [], "fast": []}
            for r in range(args.rounds):
                order = ("default", "fast") if r % 2 == 0 else ("fast", "default")
                for name in order:
                    res[name].append(one_round(default if name == "default" else fast, batch, args.prompt_len,
                                               args.steps, seed=r))
            step = {k: statistics.median(x[0] for x in v) * 1000 for k, v in res.items()}
            pre = {k: statistics.median(x[1] for x in v) * 1000 for k, v in res.items()}
            same = sum(a == b for a, b in zip(res["default"][0][2], res["fast"][0][2]))
            print(f"{batch:>5} {step['default']:>16.1f} {step['fast']:>13.1f} {step['fast'] / step['default']:>13.2f} "
                  f"{pre['default']:>19.0f} {pre['fast']:>16.0f} {same:>7}/{args.steps + 1}")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
