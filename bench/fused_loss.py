"""The LM head's loss, fused (gradients made in the forward) against the plain head and cross-entropy.

    python bench/fused_loss.py [--device cuda] [--rows 8192] [--width 768] [--vocab 50257] [--dtype bfloat16]

One forward and backward of ``F.cross_entropy(F.linear(h, w).float(), y)`` and of
``amp_backends.memory.linear_cross_entropy(h, w, y)`` under autocast, same inputs: the median step time
over ``--repeat`` runs after warm-up, the allocator's peak above the inputs (on an accelerator; none on a
CPU), the block size used, and the largest gradient difference between the two. Defaults: GPT-2 small's head at 16 x 512 tokens.
Prints one JSON line per path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from amp_backends.memory.fused_loss import chunk_rows, linear_cross_entropy


def _sync(device: torch.device) -> None:
    mod = getattr(torch, device.type, None)
    if device.type != "cpu" and mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize()


def _peak(device: torch.device, reset: bool = False) -> int | None:
    mod = getattr(torch, device.type, None)
    if device.type == "cpu" or mod is None or not hasattr(mod, "max_memory_allocated"):
        return None
    if reset:
        mod.reset_peak_memory_stats()
        return None
    return int(mod.max_memory_allocated())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=16 * 512)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(args.rows, args.width, device=device, generator=g).requires_grad_(True)
    w = (torch.randn(args.vocab, args.width, device=device, generator=g) * 0.02).requires_grad_(True)
    y = torch.randint(0, args.vocab, (args.rows,), device=device, generator=g)

    def plain() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype):
            return F.cross_entropy(F.linear(h, w).float(), y)

    def fused() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype):
            return linear_cross_entropy(h, w, y)

    grads = {}
    for name, fn in (("plain", plain), ("fused", fused)):
        for _ in range(2):
            h.grad = w.grad = None
            fn().backward()
        _sync(device)
        base = getattr(torch, device.type).memory_allocated() if device.type != "cpu" else None
        _peak(device, reset=True)
        times = []
        for _ in range(args.repeat):
            h.grad = w.grad = None
            t0 = time.perf_counter()
            loss = fn()
            loss.backward()
            _sync(device)
            times.append(time.perf_counter() - t0)
        peak = _peak(device)
        grads[name] = (h.grad.clone(), w.grad.clone())
        print(json.dumps({"path": name, "device": str(device), "torch": torch.__version__, "rows": args.rows,
                          "width": args.width, "vocab": args.vocab, "dtype": args.dtype,
                          "median_ms": round(1000 * statistics.median(times), 3),
                          "peak_above_inputs_mib": None if peak is None or base is None else round((peak - base) / 2**20, 1),
                          "block_rows": chunk_rows(args.vocab, device, dtype) if name == "fused" else None,
                          "loss": float(loss.detach())}))
    diff = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(grads["fused"], grads["plain"])]
    print(json.dumps({"max_rel_grad_diff": {"hidden": diff[0], "weight": diff[1]}}))


if __name__ == "__main__":
    main()
