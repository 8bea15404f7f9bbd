"""``amp-backends demo``: train a small CNN on the 8x8 digits under AMP on the best device.

The data are scikit-learn's bundled handwritten digits (1797 images, no download). The
loop is the same one the README shows; it works unchanged on every backend.
"""

from __future__ import annotations

import json
import math
import resource
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..checkpoint import io as checkpoint
from ..backend import Backend
from ..errors import AmpBackendsError, PerformanceWarning, UnsupportedDtypeError, first_line
from ..console import ProgressBar
from ..registry.registry import get

KIND = "demo-digits-cnn"


class DemoError(AmpBackendsError, ValueError):
    """Bad demo options."""


@dataclass
class DemoConfig:
    backend: str | None = None
    dtype: str | None = None
    epochs: int = 8
    batch_size: int = 64
    amp: bool = True
    compile: bool = False
    checkpoint: str | None = None
    resume: str | None = None
    seed: int = 0
    lr: float = 2e-3
    progress: bool = True


def build_model() -> torch.nn.Module:
    """A small CNN for 1x8x8 images: two 3x3 convolutions, a pool, two linear layers.

    Sized so that the default run stays fast where bf16 is emulated (AVX2-only CPUs).
    """
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
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


MAX_SEED = 2**32 - 1
MAX_LR = 10.0


def _check(cfg: DemoConfig) -> tuple[Backend, torch.dtype]:
    """Every option checked, and the checkpoint's place tried, before any work is done."""
    if not 1 <= cfg.epochs <= 10_000:
        raise DemoError(f"--epochs must be between 1 and 10000, got {cfg.epochs}")
    if not 1 <= cfg.batch_size <= 1_000_000:
        raise DemoError(f"--batch-size must be between 1 and 1000000, got {cfg.batch_size}")
    if not (math.isfinite(cfg.lr) and 0 < cfg.lr <= MAX_LR):
        raise DemoError(f"--lr must be a number in (0, {MAX_LR:g}], got {cfg.lr:g}")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise DemoError(f"--seed must be between 0 and 2**32-1, got {cfg.seed}")
    if cfg.resume is not None and not cfg.resume:
        raise DemoError("--resume needs the path of a checkpoint (it was given an empty string)")
    if cfg.checkpoint is not None:
        checkpoint.check_destination(cfg.checkpoint)
    be = get(cfg.backend)
    try:
        return be, be.resolve_dtype(cfg.dtype)
    except UnsupportedDtypeError as exc:  # said in the command's words, not the API's
        said = str(exc).split(". Pass one of those")[0]
        raise DemoError(f"--dtype {cfg.dtype}: {said}; leave --dtype out for the backend's default "
                        f"({_name(be.default_dtype)})") from None


def measure_amp_speed(be: Backend, dtype: torch.dtype, x: torch.Tensor, y: torch.Tensor, seed: int,
                      steps: int = 4, rounds: int = 5) -> dict[str, Any]:
    """AMP against fp32 on this device, for this model: fresh copies, one warm-up step each,
    then ``rounds`` interleaved rounds of ``steps`` steps. Returns the median per-round speed
    ratio (> 1: AMP is faster), its interquartile range, both step times, whether both are too
    short to show the device's arithmetic (``host_bound``), and the verdict that follows."""
    import statistics

    from .bench import HOST_BOUND_MS, _quartiles, verdict

    times: dict[bool, list[float]] = {True: [], False: []}
    runners = {}
    for amp in (True, False):
        torch.manual_seed(seed)
        model = build_model().to(x.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = be.grad_scaler(dtype, enabled=amp)

        def step(model=model, opt=opt, scaler=scaler, amp=amp) -> None:
            opt.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PerformanceWarning)  # already said once
                with be.autocast(dtype, enabled=amp):
                    loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        step()
        runners[amp] = step
    for r in range(rounds):
        for amp in ((True, False) if r % 2 == 0 else (False, True)):
            be.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                runners[amp]()
            be.synchronize()
            times[amp].append((time.perf_counter() - t0) / steps)
    low, mid, high = _quartiles([f / a for f, a in zip(times[False], times[True])])
    fp32_ms, amp_ms = (1e3 * statistics.median(times[k]) for k in (False, True))
    host_bound = max(fp32_ms, amp_ms) < HOST_BOUND_MS  # both short: launches and host work decide
    return {"speedup": mid, "iqr": [low, high], "fp32_step_ms": fp32_ms, "amp_step_ms": amp_ms, "host_bound": host_bound,
            "verdict": "not measurable" if host_bound else verdict(low, high)}


def _peak_memory(be: Backend) -> tuple[int, str]:
    peak = be.max_memory_allocated()
    if peak is not None:
        return peak, "device allocator peak"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"


def run(cfg: DemoConfig) -> dict[str, Any]:
    """Train and evaluate; returns the summary ``--json`` prints."""
    be, dtype = _check(cfg)
    saved = _read_resume(cfg, be, dtype) if cfg.resume else None  # a bad checkpoint fails before any work
    device = be.device()
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_digits(cfg.seed))
    torch.manual_seed(cfg.seed)
    model = build_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scaler = be.grad_scaler(dtype, enabled=cfg.amp)
    start_epoch, history = 0, []
    if saved is not None:
        start_epoch, history = _apply_resume(cfg, saved, model, opt, scaler)
    step_fn = torch.compile(model) if cfg.compile else model
    n = len(y_train)
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    bar = ProgressBar(steps_per_epoch * (cfg.epochs - start_epoch), enabled=cfg.progress)
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

            def fields(epoch: int = epoch, i: int = i, loss: torch.Tensor = loss) -> dict[str, Any]:
                stats = scaler.stats
                return {"epoch": f"{epoch + 1}/{cfg.epochs}", "step": f"{i + 1}/{steps_per_epoch}",
                        "loss": f"{loss.item():.4f}", "scale": f"{stats.scale:g}", "skipped": stats.skipped}

            bar.update(done, fields)
        bar.line(fields)
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
    batch = slice(0, cfg.batch_size)
    speed = measure_amp_speed(be, dtype, x_train[batch], y_train[batch], cfg.seed)
    return {
        "backend": be.name,
        "device": str(device),
        "dtype": _name(dtype) if cfg.amp else "float32",
        "amp": cfg.amp,
        "epochs": cfg.epochs,
        "resumed_from_epoch": start_epoch if cfg.resume else None,
        "train_loss": history,
        "test_accuracy": accuracy,
        "samples_per_second": samples / train_time if train_time else None,
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        "scaler": {"enabled": scaler.is_enabled(), **asdict(stats)},
        "native_dtypes": [_name(d) for d in be.native_dtypes()],
        "emulated_dtypes": [_name(d) for d in be.supported_dtypes() if d not in be.native_dtypes()],
        "amp_dtype_native": dtype in be.native_dtypes(),
        "amp_speedup": speed["speedup"],
        "amp_speedup_iqr": speed["iqr"],
        "amp_verdict": speed["verdict"],
        "fp32_step_ms": speed["fp32_step_ms"],
        "amp_step_ms": speed["amp_step_ms"],
        "host_bound": speed["host_bound"],
    }


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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
        cfg.checkpoint,  # type: ignore[arg-type]  # called only where cfg.checkpoint is set
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


def _read_resume(cfg: DemoConfig, be: Backend, dtype: torch.dtype) -> dict[str, Any]:
    """The checkpoint ``--resume`` names, read and checked against this run's options; nothing built yet."""
    assert cfg.resume
    state = checkpoint.load(cfg.resume, KIND, required=("epoch", "config", "model", "optimizer", "scaler", "history"))
    epoch, _ = _validate_fields(cfg.resume, state)
    expected = _identity(cfg, be, dtype)
    saved = state["config"]
    diffs = [f"{k}={saved.get(k)!r} (this run: {v!r})" for k, v in expected.items() if saved.get(k) != v]
    if diffs:
        raise checkpoint.CheckpointError(
            f"{cfg.resume} was trained with {', '.join(diffs)}; resume with the same options or start afresh"
        )
    if epoch > cfg.epochs:
        raise DemoError(f"{cfg.resume} already has {epoch} epochs; ask for --epochs {epoch} or more")
    return state


def _apply_resume(cfg: DemoConfig, state: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer,
                  scaler: Any) -> tuple[int, list[float]]:
    """Loads the checked checkpoint's states; returns its epoch count and loss history."""
    try:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
        first = first_line(exc) or type(exc).__name__
        raise checkpoint.CheckpointError(f"{cfg.resume} does not fit this model: {first[:200]}") from None
    return state["epoch"], [float(v) for v in state["history"]]


def _validate_fields(path: str, state: dict[str, Any]) -> tuple[int, list[float]]:
    """Types and values of every field a resume uses; a CheckpointError naming the first bad one."""

    def bad(field: str, why: str) -> checkpoint.CheckpointError:
        return checkpoint.CheckpointError(f"{path}: field {field!r} {why}; the checkpoint is not usable")

    epoch = state["epoch"]
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 1:
        raise bad("epoch", f"must be a whole number >= 1, got {type(epoch).__name__} {epoch!r}")
    history = state["history"]
    if not isinstance(history, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in history):
        raise bad("history", f"must be a list of numbers, got {type(history).__name__}")
    if len(history) != epoch:
        raise bad("history", f"has {len(history)} losses for {epoch} epochs")
    config = state["config"]
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        raise bad("config", f"must be a dict of options, got {type(config).__name__}")
    for field in ("model", "optimizer", "scaler"):
        if not isinstance(state[field], dict):
            raise bad(field, f"must be a state_dict (a dict), got {type(state[field]).__name__}")
    if not all(isinstance(v, torch.Tensor) for v in state["model"].values()):
        raise bad("model", "must map parameter names to tensors")
    return epoch, [float(v) for v in history]


def format_summary(result: dict[str, Any]) -> str:
    s = result["scaler"]
    native = ", ".join(result["native_dtypes"]) or "none"
    emulated = ", ".join(result["emulated_dtypes"])
    low, high = result["amp_speedup_iqr"]
    if result["host_bound"]:
        # a step of a few ms is launches and host work: no statement about the device's arithmetic
        speed_line = (f"AMP vs fp32 here   not measurable on this model: a step takes "
                      f"{result['fp32_step_ms']:.1f} ms in fp32, {result['amp_step_ms']:.1f} ms with AMP, too "
                      f"short for the device's arithmetic to decide it (amp-backends bench measures real-size models)")
    else:
        speed_line = (f"AMP vs fp32 here   {result['amp_speedup']:.2f}x [{low:.2f}-{high:.2f} over rounds] "
                      f"({result['amp_verdict']} on this small model; amp-backends bench measures real-size models)")
    lines = [
        f"backend {result['backend']} ({result['device']}), {'AMP ' + result['dtype'] if result['amp'] else 'fp32 (no AMP)'}",
        f"test accuracy      {100 * result['test_accuracy']:.2f}%",
        f"throughput         {result['samples_per_second']:.0f} samples/s" if result["samples_per_second"] else "throughput         -",
        f"peak memory        {result['peak_memory_bytes'] / 2**20:.1f} MiB ({result['peak_memory_kind']})",
        f"final train loss   {result['train_loss'][-1]:.4f}",
        f"scaler             {'enabled' if s['enabled'] else 'off (' + result['dtype'] + ' needs no scaling)'}: "
        f"scale {s['scale']:g}, {s['steps']} steps, {s['skipped']} skipped, {s['overflows']} overflows",
        f"native dtypes      {native}" + (f"; emulated: {emulated}" if emulated else ""),
        speed_line,
    ]
    return "\n".join(lines)


def main(cfg: DemoConfig, as_json: bool) -> int:
    """Train and print the summary; errors (AmpBackendsError) are the CLI's to report."""
    result = run(cfg)
    print(json.dumps(result, indent=2) if as_json else format_summary(result))
    return 0
