"""``amp-backends demo``: train a small CNN on the 8x8 digits under AMP on the best device.

The data are scikit-learn's bundled handwritten digits (1797 images, no download). The
loop is the same one the README shows; it works unchanged on every backend.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import checkpoint
from .backend import Backend
from .errors import AmpBackendsError
from .progress import Progress
from .registry import get

KIND = "demo-digits-cnn"


class DemoError(AmpBackendsError, ValueError):
    """Bad demo options."""


@dataclass
class DemoConfig:
    backend: str | None = None
    dtype: str | None = None
    epochs: int = 15
    batch_size: int = 64
    amp: bool = True
    compile: bool = False
    checkpoint: str | None = None
    resume: str | None = None
    seed: int = 0
    lr: float = 2e-3
    progress: bool = True


def build_model() -> torch.nn.Module:
    """A small CNN for 1x8x8 images: two 3x3 convolutions, a pool, two linear layers."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(64 * 4 * 4, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )


def load_digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train/test split (80/20, fixed by ``seed``) of scikit-learn's digits, scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError:
        raise DemoError("the demo needs scikit-learn for its dataset: pip install 'amp-backends[demo]'") from None
    data = sk_digits()
    images = torch.tensor(data.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return images[train], labels[train], images[test], labels[test]


def _check(cfg: DemoConfig) -> tuple[Backend, torch.dtype]:
    if cfg.epochs < 1:
        raise DemoError(f"--epochs must be at least 1, got {cfg.epochs}")
    if cfg.batch_size < 1:
        raise DemoError(f"--batch-size must be at least 1, got {cfg.batch_size}")
    if not math.isfinite(cfg.lr) or cfg.lr <= 0:
        raise DemoError(f"--lr must be a positive number, got {cfg.lr}")
    be = get(cfg.backend)
    return be, be.resolve_dtype(cfg.dtype)


def _peak_memory(be: Backend) -> tuple[int, str]:
    peak = be.max_memory_allocated()
    if peak is not None:
        return peak, "device allocator peak"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"


def run(cfg: DemoConfig) -> dict[str, Any]:
    """Train and evaluate; returns the summary ``--json`` prints."""
    be, dtype = _check(cfg)
    device = be.device()
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_digits(cfg.seed))
    torch.manual_seed(cfg.seed)
    model = build_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scaler = be.grad_scaler(dtype, enabled=cfg.amp)
    start_epoch, history = 0, []
    if cfg.resume:
        start_epoch, history = _resume(cfg, be, dtype, model, opt, scaler)
    step_fn = torch.compile(model) if cfg.compile else model
    n = len(y_train)
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    bar = Progress(steps_per_epoch * (cfg.epochs - start_epoch), enabled=cfg.progress)
    be.reset_peak_memory_stats()
    train_time, samples, done = 0.0, 0, 0
    for epoch in range(start_epoch, cfg.epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 100_003 + epoch)).to(device)
        model.train()
        be.synchronize()
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for i in range(steps_per_epoch):
            idx = order[i * cfg.batch_size : (i + 1) * cfg.batch_size]
            opt.zero_grad(set_to_none=True)
            with be.autocast(dtype, enabled=cfg.amp):
                loss = F.cross_entropy(step_fn(x_train[idx]), y_train[idx])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            total += loss.detach() * len(idx)
            done += 1
            if cfg.progress:
                stats = scaler.stats
                bar.update(done, epoch=f"{epoch + 1}/{cfg.epochs}", step=f"{i + 1}/{steps_per_epoch}",
                           loss=f"{loss.item():.4f}", scale=f"{stats.scale:g}", skipped=stats.skipped)
        be.synchronize()
        train_time += time.perf_counter() - t0
        samples += n
        history.append(round(float(total.item()) / n, 6))
        if cfg.checkpoint:
            _save(cfg, be, dtype, model, opt, scaler, epoch + 1, history)
    bar.close()
    accuracy = evaluate(model, be, dtype, cfg.amp, x_test, y_test)
    peak, peak_kind = _peak_memory(be)
    stats = scaler.stats
    return {
        "backend": be.name,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", "") if cfg.amp else "float32",
        "amp": cfg.amp,
        "epochs": cfg.epochs,
        "resumed_from_epoch": start_epoch if cfg.resume else None,
        "train_loss": history,
        "test_accuracy": accuracy,
        "samples_per_second": samples / train_time if train_time else None,
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        "scaler": {"enabled": scaler.is_enabled(), **asdict(stats)},
    }


@torch.no_grad()
def evaluate(model: torch.nn.Module, be: Backend, dtype: torch.dtype, amp: bool, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy under the same autocast as training."""
    model.eval()
    with be.autocast(dtype, enabled=amp):
        predictions = model(x).argmax(dim=1)
    return float((predictions == y).float().mean().item())


def _identity(cfg: DemoConfig, be: Backend, dtype: torch.dtype) -> dict[str, Any]:
    return {"dtype": str(dtype), "amp": cfg.amp, "batch_size": cfg.batch_size, "seed": cfg.seed, "lr": cfg.lr}


def _save(cfg: DemoConfig, be: Backend, dtype: torch.dtype, model: torch.nn.Module, opt: torch.optim.Optimizer,
          scaler: Any, epoch: int, history: list[float]) -> None:
    checkpoint.save(
        cfg.checkpoint,  # type: ignore[arg-type]
        {
            "epoch": epoch,
            "config": _identity(cfg, be, dtype),
            "backend": be.name,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scaler": scaler.state_dict(),
            "history": history,
        },
        kind=KIND,
    )


def _resume(cfg: DemoConfig, be: Backend, dtype: torch.dtype, model: torch.nn.Module, opt: torch.optim.Optimizer,
            scaler: Any) -> tuple[int, list[float]]:
    state = checkpoint.load(cfg.resume, KIND, required=("epoch", "config", "model", "optimizer", "scaler", "history"))  # type: ignore[arg-type]
    expected = _identity(cfg, be, dtype)
    saved = state["config"]
    diffs = [f"{k}={saved.get(k)!r} (this run: {v!r})" for k, v in expected.items() if saved.get(k) != v]
    if diffs:
        raise checkpoint.CheckpointError(
            f"{cfg.resume} was trained with {', '.join(diffs)}; resume with the same options or start afresh"
        )
    try:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise checkpoint.CheckpointError(f"{cfg.resume} does not fit this model: {first[:200]}") from None
    epoch = int(state["epoch"])
    if epoch > cfg.epochs:
        raise DemoError(f"{cfg.resume} already has {epoch} epochs; ask for --epochs {epoch} or more")
    return epoch, list(state["history"])


def format_summary(result: dict[str, Any]) -> str:
    s = result["scaler"]
    lines = [
        f"backend {result['backend']} ({result['device']}), {'AMP ' + result['dtype'] if result['amp'] else 'fp32 (no AMP)'}",
        f"test accuracy      {100 * result['test_accuracy']:.2f}%",
        f"throughput         {result['samples_per_second']:.0f} samples/s" if result["samples_per_second"] else "throughput         -",
        f"peak memory        {result['peak_memory_bytes'] / 2**20:.1f} MiB ({result['peak_memory_kind']})",
        f"final train loss   {result['train_loss'][-1]:.4f}",
        f"scaler             {'enabled' if s['enabled'] else 'off (' + result['dtype'] + ' needs no scaling)'}: "
        f"scale {s['scale']:g}, {s['steps']} steps, {s['skipped']} skipped, {s['overflows']} overflows",
    ]
    return "\n".join(lines)


def main(cfg: DemoConfig, as_json: bool) -> int:
    try:
        result = run(cfg)
    except (AmpBackendsError, checkpoint.CheckpointError) as exc:
        print(f"amp-backends demo: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if as_json else format_summary(result))
    return 0
