"""Per-step overhead of amp_backends against the same step written with raw torch.amp.

    python bench/overhead.py [--backend cpu] [--rounds 15] [--steps 20]

Both loops train the same model on the same data. They run interleaved (one round of
each, alternating, after warm-up), and the median per-step time of each is compared:
ratio = amp_backends / torch.amp. Goal: at most 1.02.
Rows: the backend's default dtype (bf16 on CPU: no scaler in the raw loop, the free
scaler in ours) and fp16 with dynamic loss scaling (our GradScaler vs torch's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

import amp_backends


def make_step(be: amp_backends.Backend, dtype: torch.dtype, ours: bool) -> Callable[[], None]:
    torch.manual_seed(0)
    device = be.device()
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 10)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()
    scaling = dtype == torch.float16
    if ours:
        scaler = be.grad_scaler(dtype)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with be.autocast(dtype):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        return step
    raw = torch.amp.GradScaler(be.device_type) if scaling else None

    def raw_step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(be.device_type, dtype=dtype):
            loss = loss_fn(model(x), y)
        if raw is not None:
            raw.scale(loss).backward()
            raw.step(opt)
            raw.update()
        else:
            loss.backward()
            opt.step()

    return raw_step


def timed(fn: Callable[[], None], steps: int, be: amp_backends.Backend) -> float:
    be.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    be.synchronize()
    return (time.perf_counter() - start) / steps


def measure(be: amp_backends.Backend, dtype: torch.dtype, rounds: int, steps: int) -> dict[str, float]:
    ours, raw = make_step(be, dtype, True), make_step(be, dtype, False)
    for fn in (ours, raw):
        timed(fn, steps, be)
    a, b = [], []
    for i in range(rounds):
        first, second = (ours, raw) if i % 2 == 0 else (raw, ours)
        t1, t2 = timed(first, steps, be), timed(second, steps, be)
        (a if first is ours else b).append(t1)
        (b if first is ours else a).append(t2)
    ours_s, raw_s = statistics.median(a), statistics.median(b)
    return {"dtype": str(dtype)[6:], "amp_backends_ms": ours_s * 1e3, "torch_amp_ms": raw_s * 1e3, "ratio": ours_s / raw_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", action="store_true", help="instead: where our fp16 step spends its host time")
    args = parser.parse_args(argv)
    be = amp_backends.get(args.backend)
    if args.profile:
        import cProfile
        import pstats

        step = make_step(be, torch.float16, True)
        timed(step, args.steps, be)
        profile = cProfile.Profile()
        profile.enable()
        timed(step, args.steps, be)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        return 0
    dtypes = [be.default_dtype] + ([torch.float16] if be.default_dtype != torch.float16 else [])
    rows = [measure(be, d, args.rounds, args.steps) for d in dtypes if d in be.supported_dtypes()]
    if args.json:
        print(json.dumps({"backend": be.name, "torch": torch.__version__, "rows": rows}))
        return 0
    print(f"backend {be.name}, torch {torch.__version__}, {args.rounds} interleaved rounds x {args.steps} steps, medians")
    print(f"{'dtype':<9} {'amp_backends ms':>16} {'torch.amp ms':>13} {'ratio':>7}  (goal <= 1.02)")
    for r in rows:
        print(f"{r['dtype']:<9} {r['amp_backends_ms']:16.3f} {r['torch_amp_ms']:13.3f} {r['ratio']:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
