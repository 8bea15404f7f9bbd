"""Gradient-kernel benchmark: Triton fused kernels against torch's own ops, same run.

    python bench/unscale.py                 # on a CUDA GPU: the full table (meant to take under a minute on an H100)
    python bench/unscale.py --json out.json
    python bench/unscale.py --sweep         # the kernel's launch shapes: the best per dtype and layout
    python bench/unscale.py --sweep --blocks 16384,32768 --warps 8 --json sweep.json
    TRITON_INTERPRET=1 python bench/unscale.py --smoke [--sweep]  # tiny sizes on CPU: checks the script runs

Every row times ours and the anchor interleaved on the same random (never zero) data,
after warm-up, and reports medians. Bandwidth counts the bytes a kernel must move:
2N for unscale+check (read and write), N for a read-only check.

``--sweep`` times the unscale+check of GPT-2 small's gradients in an arena and misaligned (packed
2 or 4 bytes past a 16-byte boundary) for each dtype at every block size (bytes per program,
``--blocks``) and warp count (``--warps``), as a % of a device copy, prints the best per case and
the ``TUNING`` entry per element size whose worst case is best (fp16 and bf16 share one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

GPT2_SMALL = (
    [(50257, 768), (1024, 768)]
    + [
        shape
        for _ in range(12)
        for shape in [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,),
                      (768, 3072), (3072,), (3072, 768), (768,)]
    ]
    + [(768,), (768,)]
)


def grads(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: str, seed: int = 0) -> list[torch.Tensor]:
    """Random gradients, never zero, drawn on the device (fast for GPT-2's 124M values)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for shape in shapes:
        t = torch.rand(shape, generator=g, device=device) + 0.5
        t *= torch.sign(torch.randn(shape, generator=g, device=device) + 1e-3)
        out.append(t.to(dtype))
    return out


def arena_and_packed(src_grads: list[torch.Tensor], device: torch.device) -> tuple[object, list[torch.Tensor], list[torch.Tensor]]:
    """An arena holding ``src_grads`` (its FlatGroup and views: 16-byte aligned slots) and the same
    gradients packed one after another from a base 1 element past an aligned allocation."""
    import amp_backends

    params = [torch.nn.Parameter(torch.empty_like(t)) for t in src_grads]
    for p, t in zip(params, src_grads):
        p.grad = t.clone()
    arena = amp_backends.flat_grads(torch.optim.SGD(params, lr=0.0))  # copies the gradients in
    group = arena.groups[0]
    total = sum(t.numel() for t in src_grads)
    raw = torch.empty(total + 8, dtype=src_grads[0].dtype, device=device)
    base = raw[1:]  # 2 or 4 bytes past an aligned allocation
    packed, at = [], 0
    for t in src_grads:
        packed.append(base[at:at + t.numel()].view(t.shape))
        packed[-1].copy_(t)
        at += t.numel()
    return group, group.views(), packed


class _Rows(list):
    """The result rows; each one announced on stderr as it is measured."""

    def append(self, row: dict[str, object]) -> None:
        print(f"measured: {row['case']}", file=sys.stderr, flush=True)
        super().append(row)


def timer(device: str, warmup: int, reps: int) -> Callable[[Callable[[], object]], float]:
    """Median seconds of ``fn``: CUDA events through triton.testing.do_bench, a host clock on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=warmup, rep=reps, return_mode="median") / 1e3

    def host(fn: Callable[[], object]) -> float:
        fn()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    return host


def host_time(fn: Callable[[], object], device: str, calls: int = 200) -> float:
    """Median host seconds per call, without waiting for the device (launch overhead)."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
        if device == "cuda" and len(samples) % 20 == 0:
            torch.cuda.synchronize()
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU under TRITON_INTERPRET=1)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--sweep", action="store_true", help="instead of the table: the kernel's launch shapes")
    parser.add_argument("--blocks", type=_ints, default=[8192, 16384, 32768],
                        help="with --sweep: bytes per program, comma-separated (elements: bytes / element size)")
    parser.add_argument("--warps", type=_ints, default=[4, 8, 16], help="with --sweep: warps per program, comma-separated")
    parser.add_argument("--sweep-rep", type=int, default=100, help="with --sweep: ms of repetitions per shape (CUDA)")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print("no CUDA device: run on a GPU, or use --smoke with TRITON_INTERPRET=1 to check the script", file=sys.stderr)
        return 2
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    from amp_backends.gradients.groups import TensorGroup
    from amp_backends.gradients.kernel import TORCH_KERNEL
    from amp_backends_plugins.triton import TritonKernel

    def op(kernel, tensors, found_inf, inv_scale=None, norm_sq=None):  # the kernel's one op on one list
        kernel.grad_op_(TensorGroup(tensors[0].device, tensors[0].dtype, list(tensors)), found_inf, inv_scale, norm_sq)

    ours = TritonKernel()
    torch_op = TORCH_KERNEL
    measure = timer(device, warmup=25, reps=200)
    big = 2**12 if args.smoke else 2**28  # fp32 elements: 1 GiB on a GPU
    gpt2 = [tuple(max(1, d // 32) for d in s) for s in GPT2_SMALL] if args.smoke else GPT2_SMALL
    small = [(37,)] * (50 if args.smoke else 2000)
    dev = torch.device(device)
    one = torch.ones((), device=dev)
    inv = torch.full((), 1.0, device=dev)  # applied again and again: keeps the data unchanged
    rows: list[dict[str, object]] = _Rows()

    def found() -> torch.Tensor:
        return torch.zeros((), device=dev)

    # 1. copy bandwidth, the ceiling
    src = grads([(big,)], torch.float32, device)[0]
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    t_copy = measure(lambda dst=dst, src=src: dst.copy_(src))
    copy_bw = 2 * nbytes / t_copy
    rows.append({"case": "device copy" + ("" if args.smoke else ", 1 GiB fp32"), "ours_ms": t_copy * 1e3,
                 "GB/s": copy_bw / 1e9})
    del dst
    if args.sweep:
        del src
        shapes = gpt2[1:14] if args.smoke else gpt2  # smoke: one layer's worth, the interpreter is slow
        sweep_rows = sweep(ours, shapes, device, copy_bw, timer(device, warmup=10, reps=args.sweep_rep),
                           args.blocks, args.warps, op)
        print_sweep(sweep_rows)
        finish(header(device, triton, args, started), rows, {"sweep": sweep_rows}, args.json)
        return 0

    # 2. unscale + check on one big gradient: % of copy bandwidth
    buf = [src]
    t_ours = measure(lambda buf=buf: op(ours, buf, found(), inv))
    t_ref = measure(lambda buf=buf: op(torch_op, buf, found(), inv))
    label = "1 GiB" if not args.smoke else f"{nbytes >> 10} KiB"
    rows.append({"case": f"unscale+check {label} fp32", "ours_ms": t_ours * 1e3, "torch_ms": t_ref * 1e3,
                 "speedup": t_ref / t_ours, "GB/s": 2 * nbytes / t_ours / 1e9, "pct_of_copy": 100 * (2 * nbytes / t_ours) / copy_bw})
    del src, buf

    # 2b. an arena (aligned slots) and the same gradients packed from a base 2 or 4 bytes off
    #     16-byte alignment (a head block each, then the vectorized body), against torch's op on the same layouts
    def anchor(fn: Callable[[], object], t_ours: float) -> dict[str, float]:
        """torch's op where it runs (its CUDA kernel has no bf16: then no anchor)."""
        try:
            fn()
        except (NotImplementedError, RuntimeError):
            return {}
        t = measure(fn)
        return {"torch_ms": t * 1e3, "speedup": t / t_ours}

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        src_grads = grads(gpt2, dtype, device, seed=4)
        group, views, packed = arena_and_packed(src_grads, dev)
        n_bytes = sum(t.numel() for t in views) * views[0].element_size()
        t_ours = measure(lambda group=group: ours.grad_op_(group, found(), inv))
        t_ref = anchor(lambda views=views: op(torch_op, views, found(), inv), t_ours)
        rows.append({"case": f"arena unscale+check GPT-2 {str(dtype)[6:]}", "ours_ms": t_ours * 1e3,
                     **t_ref, "GB/s": 2 * n_bytes / t_ours / 1e9, "pct_of_copy": 100 * (2 * n_bytes / t_ours) / copy_bw})
        t_ours = measure(lambda packed=packed: op(ours, packed, found(), inv))
        t_ref = anchor(lambda packed=packed: op(torch_op, packed, found(), inv), t_ours)
        rows.append({"case": f"misaligned unscale+check GPT-2 {str(dtype)[6:]}", "ours_ms": t_ours * 1e3,
                     **t_ref, "GB/s": 2 * n_bytes / t_ours / 1e9, "pct_of_copy": 100 * (2 * n_bytes / t_ours) / copy_bw})
        del group, views, packed, src_grads

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        g = grads(gpt2, dtype, device, seed=1)
        n_bytes = sum(t.numel() for t in g) * g[0].element_size()
        t_ours = measure(lambda g=g: op(ours, g, found(), inv))
        t_ref = anchor(lambda g=g: op(torch_op, g, found(), inv), t_ours)
        rows.append({"case": f"unscale+check GPT-2 small {str(dtype)[6:]}", "ours_ms": t_ours * 1e3,
                     **t_ref, "GB/s": 2 * n_bytes / t_ours / 1e9})

    # 3. unscale + clip: ours = one fused pass + the clip multiply; torch = unscale_ + clip_grad_norm_(foreach)
    g = grads(gpt2, torch.float32, device, seed=2)
    params = [torch.nn.Parameter(torch.empty_like(t)) for t in g]
    for p, t in zip(params, g):
        p.grad = t  # shares storage: torch's recipe and ours see the same gradients

    def ours_clip() -> None:
        norm_sq = torch.zeros((), device=dev)
        op(ours, g, found(), inv, norm_sq)
        coef = torch.clamp(1e9 / (norm_sq.sqrt() + 1e-6), max=1.0)  # max_norm high: the data stays the same
        torch._foreach_mul_(g, coef)

    def torch_clip() -> None:
        op(torch_op, g, found(), inv)
        torch.nn.utils.clip_grad_norm_(params, 1e9, foreach=True)

    t_ours, t_ref = measure(ours_clip), measure(torch_clip)
    rows.append({"case": "unscale+clip GPT-2 small fp32", "ours_ms": t_ours * 1e3, "torch_ms": t_ref * 1e3,
                 "speedup": t_ref / t_ours})

    # 4. read-only check (fused optimizers) against torch's dummy unscale
    t_ours = measure(lambda: op(ours, g, found()))
    t_ref = measure(lambda: op(torch_op, g, found(), one))
    n_bytes = sum(t.numel() for t in g) * 4
    rows.append({"case": "read-only check GPT-2 small fp32", "ours_ms": t_ours * 1e3, "torch_ms": t_ref * 1e3,
                 "speedup": t_ref / t_ours, "GB/s": n_bytes / t_ours / 1e9})

    # 5. host time per call with many small tensors
    s = grads(small, torch.float32, device, seed=3)
    calls = 3 if args.smoke else 200
    h_ours = host_time(lambda: op(ours, s, found(), inv), device, calls)
    h_ref = host_time(lambda: op(torch_op, s, found(), inv), device, calls)
    rows.append({"case": f"host time, {len(s)} small tensors", "ours_ms": h_ours * 1e3, "torch_ms": h_ref * 1e3,
                 "speedup": h_ref / h_ours, "ours_us": h_ours * 1e6})

    finish(header(device, triton, args, started), rows, {}, args.json)
    return 0


def header(device: str, triton: object, args: argparse.Namespace, started: float) -> dict[str, object]:
    from amp_backends_plugins.triton import _kernels

    return {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or platform.machine()}), Triton interpreter",
        "torch": torch.__version__,
        "triton": triton.__version__,  # type: ignore[attr-defined]
        "smoke": args.smoke,
        "tuning": {size: {"block": t.block, "num_warps": t.num_warps} for size, t in _kernels.TUNING.items()},
        "seconds": round(time.perf_counter() - started, 1),
    }


def finish(head: dict[str, object], rows: list[dict[str, object]], extra: dict[str, object], path: str | None) -> None:
    """The table on stdout (and everything in ``path`` as JSON)."""
    print(f"# {head['device']} | torch {head['torch']} | triton {head['triton']} | {head['date']} | "
          f"tuning {head['tuning']} | {head['seconds']} s")
    print(f"{'case':<40} {'ours ms':>9} {'torch ms':>9} {'speedup':>8} {'GB/s':>8} {'% copy':>7}")
    for r in rows:
        def cell(key: str, fmt: str, r: dict[str, object] = r) -> str:
            width = int(fmt.split(".")[0])
            return format(r[key], fmt) if key in r else "-".rjust(width)

        print(f"{r['case']:<40} {cell('ours_ms', '9.3f')} {cell('torch_ms', '9.3f')} {cell('speedup', '8.2f')} "
              f"{cell('GB/s', '8.0f')} {cell('pct_of_copy', '7.1f')}")
    if path:
        with open(path, "w") as fh:
            json.dump({**head, "rows": rows, **extra}, fh, indent=2)


def sweep(ours: object, shapes: list[tuple[int, ...]], device: str, copy_bw: float,
          measure: Callable[[Callable[[], object]], float], blocks: list[int], warps: list[int],
          op: Callable[..., None]) -> list[dict[str, object]]:
    """% of a device copy for each dtype x layout (arena, misaligned) x block bytes x warps."""
    from amp_backends_plugins.triton import _kernels

    dev = torch.device(device)
    inv = torch.full((), 1.0, device=dev)
    saved = dict(_kernels.TUNING)
    out: list[dict[str, object]] = []
    try:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            size = torch.empty((), dtype=dtype).element_size()
            group, views, packed = arena_and_packed(grads(shapes, dtype, device, seed=4), dev)
            n_bytes = 2 * sum(t.numel() for t in views) * size
            cases = {"arena": lambda group=group: ours.grad_op_(group, torch.zeros((), device=dev), inv),  # type: ignore[attr-defined]
                     "misaligned": lambda packed=packed: op(ours, packed, torch.zeros((), device=dev), inv)}
            for nbytes in blocks:
                for w in warps:
                    _kernels.TUNING[size] = _kernels.Tuning(nbytes // size, w)
                    for case, fn in cases.items():
                        row: dict[str, object] = {"dtype": str(dtype)[6:], "case": case, "block_bytes": nbytes,
                                                  "block": nbytes // size, "num_warps": w}
                        try:
                            t = measure(fn)
                            row.update(ms=t * 1e3, pct_of_copy=100 * n_bytes / t / copy_bw)
                        except Exception as exc:  # noqa: BLE001 - a shape that does not compile is a result
                            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        print(f"swept: {row}", file=sys.stderr, flush=True)
                        out.append(row)
            _kernels.TUNING[size] = saved[size]
            del group, views, packed
    finally:
        _kernels.TUNING.update(saved)
    return out


def print_sweep(rows: list[dict[str, object]]) -> None:
    """Every shape's % of copy, the best per dtype and layout, and the TUNING entry per element size
    whose worst case (over its dtypes and both layouts) is best."""
    print(f"{'dtype':<9} {'layout':<11} {'block B':>8} {'block':>6} {'warps':>5} {'ms':>8} {'% copy':>7}")
    for r in rows:
        tail = f"{r['ms']:8.3f} {r['pct_of_copy']:7.1f}" if "ms" in r else f"ERROR {r['error']}"
        print(f"{r['dtype']:<9} {r['case']:<11} {r['block_bytes']:>8} {r['block']:>6} {r['num_warps']:>5} {tail}")
    ok = [r for r in rows if "ms" in r]
    print("best per case:")
    for key in sorted({(r["dtype"], r["case"]) for r in ok}):
        best = max((r for r in ok if (r["dtype"], r["case"]) == key), key=lambda r: r["pct_of_copy"])
        print(f"  {key[0]:<9} {key[1]:<11} block {best['block_bytes']} B ({best['block']}), {best['num_warps']} warps: "
              f"{best['pct_of_copy']:.1f}% of copy")
    print("suggested TUNING (best worst case per element size):")
    for size, dtypes in ((4, ("float32",)), (2, ("float16", "bfloat16"))):
        shapes: dict[tuple[int, int], list[float]] = {}
        for r in ok:
            if r["dtype"] in dtypes:
                shapes.setdefault((r["block_bytes"], r["num_warps"]), []).append(r["pct_of_copy"])  # type: ignore[arg-type]
        full = {k: v for k, v in shapes.items() if len(v) == 2 * len(dtypes)}
        if full:
            (nbytes, w), worst = max(((k, min(v)) for k, v in full.items()), key=lambda kv: kv[1])
            print(f"  {size}: Tuning({nbytes // size}, {w})  worst case {worst:.1f}% of copy")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


if __name__ == "__main__":
    sys.exit(main())
