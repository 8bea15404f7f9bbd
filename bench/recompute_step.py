"""What selective recomputation costs in step time and saves in memory on Transformers' GPT-2 and BERT.

    python bench/recompute_step.py                 # GPT-2 small 16 x 512, BERT-base 64 x 128 (a GPU)
    python bench/recompute_step.py --smoke         # 2 small layers, a CPU in seconds
    python bench/recompute_step.py --ledger        # full size, the ledger's peak on fake tensors (any CPU)

Each model (transformers' GPT2LMHeadModel with its own loss, BertForSequenceClassification, default
configurations: dropout 0.1, their GELU, sdpa attention; ``--attn eager`` for the eager path) trains
with AdamW under bf16 autocast, with and without :func:`amp_backends.memory.selective_recompute`. The
two run interleaved, one step each in turn after warm-up; the median step time of each is reported,
and on an accelerator the allocator's peak of each. ``--ledger`` counts one training step of each
model at full size on fake tensors instead (:func:`amp_backends.memory.fake.measure`: every storage, no
arithmetic), float32 and bf16 autocast, with and without the lever, and prints the ledger's peaks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import amp_backends
from amp_backends.memory.recompute import selective_recompute


def build_model(name: str, smoke: bool, attn: str) -> torch.nn.Module:
    """Transformers' GPT-2 small or BERT-base (default configurations; ``smoke``: 2 small layers)."""
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if name == "gpt2":
        small = {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 1024, "n_positions": 128} if smoke else {}
        return GPT2LMHeadModel(GPT2Config(**small, bos_token_id=0, eos_token_id=0, attn_implementation=attn))
    small = ({"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 512,
              "vocab_size": 1024, "max_position_embeddings": 128} if smoke else {})
    return BertForSequenceClassification(BertConfig(**small, attn_implementation=attn))


def build_batch(name: str, smoke: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The bench's batch: GPT-2 16 x 512 tokens (its own labels), BERT 64 x 128 (smoke: 4 x 128, 8 x 128)."""
    if name == "gpt2":
        batch, seq, vocab = (4, 128, 1024) if smoke else (16, 512, 50257)
        x = torch.randint(0, vocab, (batch, seq), device=device)
        return x, x
    batch, seq, vocab = (8, 128, 1024) if smoke else (64, 128, 30522)
    return torch.randint(0, vocab, (batch, seq), device=device), torch.randint(0, 2, (batch,), device=device)


def make_step(be: amp_backends.Backend, name: str, smoke: bool, attn: str, lever: bool) -> Callable[[], None]:
    model = build_model(name, smoke, attn).to(be.device())
    x, y = build_batch(name, smoke, be.device())
    model.train()
    if lever:
        selective_recompute(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with be.autocast(torch.bfloat16):
            loss = model(x, labels=y).loss
        loss.backward()
        opt.step()

    return step


def measure(be: amp_backends.Backend, name: str, smoke: bool, attn: str, steps: int, warmup: int) -> dict[str, Any]:
    steps_of = {lever: make_step(be, name, smoke, attn, lever) for lever in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    peaks: dict[bool, int | None] = {False: None, True: None}
    for lever, step in steps_of.items():
        for _ in range(warmup):
            step()
        if be.device_type != "cpu":
            be.synchronize()
            be.reset_peak_memory_stats()
            step()
            be.synchronize()
            peaks[lever] = be.max_memory_allocated()
    for _ in range(steps):
        for lever, step in steps_of.items():
            be.synchronize()
            t = time.perf_counter()
            step()
            be.synchronize()
            times[lever].append(time.perf_counter() - t)
    plain, lean = statistics.median(times[False]), statistics.median(times[True])
    row: dict[str, Any] = {"model": name, "attn": attn, "plain_ms": plain * 1e3, "recompute_ms": lean * 1e3,
                           "ratio": lean / plain}
    plain_peak, lean_peak = peaks[False], peaks[True]
    if plain_peak is not None and lean_peak is not None:
        row.update(plain_peak_mib=plain_peak / 2**20, recompute_peak_mib=lean_peak / 2**20,
                   saving=1 - lean_peak / plain_peak)
    return row


def ledger_rows(attn: str) -> list[dict[str, Any]]:
    """The ledger's peak of a full-size step of each model on fake tensors, per mode and lever."""
    from amp_backends.memory.fake import Setup, measure, on_meta_then_fake

    rows = []
    for name in ("gpt2", "bert"):
        for amp in (False, True):
            peaks = {}
            for lever in (False, True):
                def make(lever: bool = lever, amp: bool = amp) -> Setup:
                    model = on_meta_then_fake(lambda: build_model(name, False, attn)).train()
                    x, y = build_batch(name, False, torch.device("cpu"))
                    if lever:
                        selective_recompute(model)
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

                    def step(ledger: Any) -> None:
                        opt.zero_grad(set_to_none=True)
                        with ledger.phase("forward"), torch.autocast("cpu", torch.bfloat16, enabled=amp):
                            loss = model(x, labels=y).loss
                        with ledger.phase("backward"):
                            loss.backward()
                        with ledger.phase("optimizer"):
                            opt.step()

                    return Setup(model, opt, step, inputs=(x, y))

                peaks[lever] = measure(make).peak
            rows.append({"model": name, "attn": attn, "mode": "amp-bf16" if amp else "fp32",
                         "plain_peak_mib": peaks[False] / 2**20, "recompute_peak_mib": peaks[True] / 2**20,
                         "saving": 1 - peaks[True] / peaks[False]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--smoke", action="store_true", help="two small layers, a few steps (a CPU)")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--ledger", action="store_true", help="full size, counted on fake tensors")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.ledger:
        rows = ledger_rows(args.attn)
        if args.json:
            print(json.dumps({"setup": f"fake tensors, torch {torch.__version__}", "rows": rows}, indent=2))
            return
        print(f"full size, ledger's peak on fake tensors (cpu kernels' choices), torch {torch.__version__}")
        for r in rows:
            print(f"{r['model']:5} {r['mode']:8} ({r['attn']}): {r['plain_peak_mib']:,.0f} -> "
                  f"{r['recompute_peak_mib']:,.0f} MiB ({-100 * r['saving']:+.1f}%)")
        return
    be = amp_backends.get(args.backend)
    steps = args.steps or (10 if args.smoke else 8)
    rows = [measure(be, name, args.smoke, args.attn, steps, warmup=2 if args.smoke else 3) for name in ("gpt2", "bert")]
    head = f"backend {be.name}, torch {torch.__version__}, {'smoke' if args.smoke else 'full'} size, bf16 autocast"
    if args.json:
        print(json.dumps({"setup": head, "rows": rows}, indent=2))
        return
    print(head)
    for r in rows:
        mem = (f", peak {r['plain_peak_mib']:,.0f} -> {r['recompute_peak_mib']:,.0f} MiB ({-100 * r['saving']:+.1f}%)"
               if "saving" in r else "")
        print(f"{r['model']:5} ({r['attn']}): step {r['plain_ms']:.1f} -> {r['recompute_ms']:.1f} ms "
              f"({r['ratio']:.2f}x){mem}")


if __name__ == "__main__":
    main()
