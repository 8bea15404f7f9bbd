"""The optimizer step of the lean mode against plain AMP's, on a model's real parameter shapes.

    python bench/lean_step.py                      # GPT-2 small's and BERT-base's shapes on the best device
    python bench/lean_step.py --smoke              # tiny shapes, a few repetitions (CPU, seconds)
    python bench/lean_step.py --json out.json

Four steps over the same shapes, interleaved, each timed as a whole (device events where the device has
them, else the host clock after a synchronize), medians of the repetitions:

- ``amp-foreach`` / ``amp-fused``: torch's AdamW over float32 parameters with float32 gradients (what
  plain autocast trains), ``foreach=True`` / ``fused=True``;
- ``lean-foreach`` / ``lean-fused``: the same AdamW wrapped by ``memory_lean(weights=bfloat16)``: bfloat16
  parameters and gradients, float32 masters (the gradient copy into one float32 buffer, the update, the
  rounding copy back).

The ratio ``lean / amp`` for the same implementation is the master step's cost beyond plain AMP's step;
the whole training step's ratio is the time bench's (``amp-backends bench``, ``lean-bf16`` against
``amp-bfloat16``). Also counted: ops dispatched per step (a TorchDispatchMode, views and allocations left
out) for each, the proxy a CPU can check.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from amp_backends.memory.master import MasterWeights

KINDS = ("amp-foreach", "lean-foreach", "amp-fused", "lean-fused")


def shapes(model: str, smoke: bool) -> list[tuple[int, ...]]:
    """The parameter shapes of GPT-2 small (tied head) or BERT-base (with pooler and classifier)."""
    if smoke:
        return [(64, 32), (32,), (32, 96), (96,), (32, 32), (32,)] * 3
    if model == "gpt2":
        d, layers, vocab, ctx = 768, 12, 50257, 1024
        block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
        return [(vocab, d), (ctx, d)] + block * layers + [(d,), (d,)]
    d, layers, vocab = 768, 12, 30522
    block = [(d, d), (d,)] * 4 + [(d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    return [(vocab, d), (512, d), (2, d), (d,), (d,)] + block * layers + [(d, d), (d,), (2, d), (2,)]


def _timer(device: torch.device):
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def run(fn, reps: int) -> float:
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / reps
        return run

    def run_host(fn, reps: int) -> float:
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) * 1e3 / reps
    return run_host


def _count(opt: Any) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    free = {"empty", "empty_strided", "split_with_sizes", "view", "alias", "detach", "_local_scalar_dense",
            "_record_function_enter_new", "_record_function_exit"}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func._schema.name.split("::")[-1] not in free:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        opt.step()
    return Count.n


def measure(model: str, device: torch.device, smoke: bool, rounds: int, reps: int) -> dict[str, Any]:
    dims = shapes(model, smoke)
    setups = {}
    for kind in KINDS:
        if kind.endswith("fused"):
            try:
                torch.optim.AdamW([nn.Parameter(torch.zeros(1, device=device))], fused=True)
            except (RuntimeError, TypeError):
                continue
        setups[kind] = _setup(kind, dims, device)
    timer = _timer(device)
    times: dict[str, list[float]] = {k: [] for k in setups}
    for opt in setups.values():
        opt.step()  # warm-up: state, masters, kernels
    for _ in range(rounds):
        for kind, opt in setups.items():
            times[kind].append(timer(opt.step, reps))
    out: dict[str, Any] = {"model": model, "params": sum(int(torch.Size(s).numel()) for s in dims),
                           "tensors": len(dims), "step_ms": {k: statistics.median(v) for k, v in times.items()},
                           "ops": {k: _count(opt) for k, opt in setups.items()}}
    out["lean_vs_amp"] = {impl: out["step_ms"][f"lean-{impl}"] / out["step_ms"][f"amp-{impl}"]
                          for impl in ("foreach", "fused") if f"lean-{impl}" in out["step_ms"]}
    return out


def _setup(kind: str, dims: list[tuple[int, ...]], device: torch.device) -> Any:
    """The optimizer of ``kind`` over parameters of ``dims`` with gradients set."""
    torch.manual_seed(0)
    low = torch.bfloat16 if kind.startswith("lean") else torch.float32
    params = [nn.Parameter((torch.randn(s, device=device) * 0.02).to(low)) for s in dims]
    for p in params:
        p.grad = (torch.randn(p.shape, device=device) * 1e-3).to(low)
    opt = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if kind.endswith("fused") else {"foreach": True}))
    # the lean optimizer memory_lean makes: bfloat16 parameters get float32 masters from their values
    return MasterWeights(opt) if kind.startswith("lean") else opt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--models", default="gpt2,bert")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rounds = args.rounds or (3 if args.smoke else 15)
    reps = 2 if args.smoke or device.type == "cpu" else 10
    rows = [measure(m, device, args.smoke, rounds, reps) for m in args.models.split(",")]
    info = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "device": (
        torch.cuda.get_device_name() if device.type == "cuda" else "cpu"), "rows": rows}
    for row in rows:
        print(f"{row['model']}: {row['params'] / 1e6:.1f}M parameters in {row['tensors']} tensors")
        for kind, ms in row["step_ms"].items():
            print(f"  {kind:13s} {ms:8.3f} ms  {row['ops'][kind]:3d} ops")
        for impl, ratio in row["lean_vs_amp"].items():
            print(f"  lean/amp ({impl}): {ratio:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
