"""The ``amp-backends`` command: ``info``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from ..errors import AmpBackendsError

_DEMO_EPOCHS = 8  # DemoConfig's default (demo is imported only when it runs)
# the bench's models (bench_models is imported only when bench runs; test_cli keeps these in step)
_BENCH_MODELS = ("resnet50", "bert-base", "gpt2-small", "hf-gpt2", "hf-bert", "tv-resnet50", "llama-block", "mlp", "cnn",
                 "transformer")
# the built-in real models, and Transformers' and torchvision's where those are installed
_BENCH_DEFAULT = ("resnet50", "bert-base", "gpt2-small", "hf-gpt2", "hf-bert", "tv-resnet50")


class CLIError(AmpBackendsError):
    """A command-line value that cannot work; reported in one line, before any work."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): ``amp-backends demo: error: ...``."""

    def error(self, message: str) -> None:  # type: ignore[override]  # argparse's error is typed NoReturn; ours exits too
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="amp-backends", description="Mixed precision on every PyTorch device.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    info = sub.add_parser("info", help="list backends: available or why not, dtypes, kernel, plugin")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.add_argument("-v", "--verbose", action="store_true", help="also list every plugin")

    demo = sub.add_parser("demo", help="train a small CNN on 8x8 digits with AMP on the best device")
    demo.add_argument("--backend", help="backend name (default: best available, or $AMP_BACKEND)")
    demo.add_argument("--dtype", help="autocast dtype, e.g. float16 or bfloat16 (default: the backend's)")
    demo.add_argument("--epochs", type=int, default=_DEMO_EPOCHS)
    demo.add_argument("--batch-size", type=int, default=64)
    demo.add_argument("--lr", type=float, default=2e-3)
    demo.add_argument("--no-amp", action="store_true", help="train in fp32 (for comparison)")
    demo.add_argument("--compile", action="store_true", help="torch.compile the model")
    demo.add_argument("--checkpoint", metavar="PATH", help="save model, optimizer and scaler after every epoch")
    demo.add_argument("--resume", metavar="PATH", help="continue from a checkpoint")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="print a JSON summary (no progress bar)")

    bench = sub.add_parser("bench", help="fp32, TF32 and AMP step time and peak memory, per model")
    bench.add_argument("--backend", help="backend name (default: best available, or $AMP_BACKEND)")
    bench.add_argument("--models", default=None,
                       help=f"comma-separated, from: {', '.join(_BENCH_MODELS)} (default: {','.join(_BENCH_DEFAULT)}, "
                            "the hf-* and tv-* ones where Transformers and torchvision are installed)")
    bench.add_argument("--size", choices=("auto", "full", "small"), default="auto",
                       help="full: the real models at real batch sizes; small: narrower, for CPUs "
                            "(default auto: full on an accelerator, small on a CPU)")
    bench.add_argument("--list", action="store_true", help="list the models and their parameter counts, then exit")
    bench.add_argument("--rounds", type=int, default=None,
                       help="timed rounds per mode (default: 5 at small size, 20 at full size)")
    bench.add_argument("--warmup", type=int, default=None, help="warm-up steps before the timed rounds (default 2)")
    bench.add_argument("--steps-per-round", type=int, default=None, dest="steps",
                       help="steps each round times (default: one on a CPU, enough for 0.2 s on an accelerator, 3 to 16)")
    bench.add_argument("--scale", type=float, default=1.0, help="batch-size factor, in (0, 8]")
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--plot", metavar="PNG", help="also draw the table (needs matplotlib)")
    bench.add_argument("--memory", action="store_true",
                       help="instead of timing: the training memory of each model and mode by part (parameters, "
                            "gradients, optimizer, masters, weight copies, activations), counted at --size (default "
                            "full) without arithmetic on a CPU, and each mode's loss after --loss-steps steps")
    bench.add_argument("--loss-steps", type=int, default=None,
                       help="with --memory: training steps (small size) before the loss is read (200); 0: no loss")

    check = sub.add_parser("check", help="what AMP will do to a model: precision per layer, shapes, fp16 range")
    check.add_argument("target", metavar="MODULE:FACTORY",
                       help="an importable factory returning (model, example_inputs[, loss_fn]); or bench:NAME "
                            f"for a bench model ({', '.join(_BENCH_MODELS)})")
    check.add_argument("--backend", help="backend name (default: best available, or $AMP_BACKEND)")
    check.add_argument("--dtype", help="autocast dtype, e.g. float16 or bfloat16 (default: the backend's)")
    check.add_argument("--size", choices=("full", "small"), default="small", help="bench models only")
    check.add_argument("--policy", choices=("none", "recipe"), default="none",
                       help="apply a precision policy first (recipe: norms and the head in float32)")
    check.add_argument("--loss-scale", type=float, default=None, help="judge fp16 underflow at this scale (default 65536)")
    check.add_argument("--fp8", nargs="?", const="tensorwise",
                       choices=("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "mxfp8_with_gw_hp"),
                       help="train the Linear layers that can in fp8 with this recipe (default tensorwise); emulated "
                            "where the device has no fp8 matmul (needs torchao: pip install 'amp-backends[fp8]')")
    check.add_argument("--plan", action="store_true",
                       help="measure each Linear layer in every candidate format and print the per-layer precision "
                            "plan within --budget, with each choice's reason (--json: per layer its format and each "
                            "candidate's measured error)")
    check.add_argument("--budget", type=float, default=None,
                       help="with --plan: the largest relative error a layer's output and gradients may have (0.05)")
    check.add_argument("--emulate", action="store_true",
                       help="with --plan: 8-bit formats may be planned on a device without them (their numerics)")
    check.add_argument("--save", metavar="PATH", help="with --plan: save the plan as JSON (precision_policy(plan=PATH))")
    check.add_argument("--json", action="store_true")
    return parser


#: What matplotlib's savefig writes by its own name's suffix (the ones it always has).
_PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp")


def _check_plot_path(path: str) -> None:
    target = Path(path)
    if not path or target.is_dir():
        raise CLIError(f"--plot needs a PNG file name, got {path!r}")
    if target.suffix.lower() not in _PLOT_SUFFIXES:
        raise CLIError(f"--plot {path!r}: matplotlib writes {', '.join(_PLOT_SUFFIXES)} by the name's suffix; "
                       "name a .png file")
    if not target.parent.is_dir():
        raise CLIError(f"--plot: the folder {str(target.parent)!r} does not exist")
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise CLIError("--plot needs matplotlib: pip install 'amp-backends[plot]'")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; bad input is one line on stderr and exit status 2, never a traceback."""
    import warnings

    from .warning_format import format_warning

    args = _parser().parse_args(argv)
    warnings.formatwarning = format_warning  # the package's own warnings in its words; others' as Python prints them
    try:
        return _run(args)
    except BrokenPipeError:  # the reader stopped early (`amp-backends info | head -1`): not an error
        _silence_stdout()
        return 0
    except (AmpBackendsError, OSError) as exc:
        print(f"amp-backends {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"amp-backends {args.command}: interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush to a closed pipe does
    not fail again at exit."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _run(args: argparse.Namespace) -> int:
    if args.command == "info":
        from . import info

        return info.main(as_json=args.json, verbose=args.verbose)
    if args.command == "demo":
        from .demo import DemoConfig
        from .demo import main as demo_main

        cfg = DemoConfig(
            backend=args.backend, dtype=args.dtype, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
            amp=not args.no_amp, compile=args.compile, checkpoint=args.checkpoint, resume=args.resume,
            seed=args.seed, progress=not args.json,
        )
        return demo_main(cfg, as_json=args.json)
    if args.command == "bench":
        given = args.models is not None
        models = [m.strip() for m in (args.models if given else ",".join(_BENCH_DEFAULT)).split(",") if m.strip()]
        unknown = [m for m in models if m not in _BENCH_MODELS]
        if unknown or not models:
            raise CLIError(f"--models: unknown model {', '.join(map(repr, unknown)) or '(none given)'}; "
                           f"choose from {', '.join(_BENCH_MODELS)} (amp-backends bench --list)")
        from .bench_models import model_unavailable

        missing = [why for m in models if (why := model_unavailable(m))]
        if missing and given:
            raise CLIError(f"--models: {'; '.join(missing)}")
        models = [m for m in models if not model_unavailable(m)]
        if args.list:
            from .bench import list_models

            print(list_models(as_json=args.json))
            return 0
        if args.memory:  # the timing options would be accepted and ignored
            timing = [name for name, value in (("--rounds", args.rounds), ("--warmup", args.warmup),
                                               ("--steps-per-round", args.steps), ("--plot", args.plot))
                      if value is not None]
            if timing:
                named = ", ".join(timing)
                raise CLIError(f"{named} {'goes' if len(timing) == 1 else 'go'} with the time bench, not --memory, which "
                               f"times nothing and draws no plot: drop {named}, or run amp-backends bench without --memory")
        warmup = 2 if args.warmup is None else args.warmup
        if (args.rounds is not None and args.rounds < 1) or warmup < 0:
            raise CLIError(f"--rounds must be >= 1 and --warmup >= 0, got {args.rounds} and {warmup}")
        if args.steps is not None and not 1 <= args.steps <= 1000:
            raise CLIError(f"--steps-per-round must be in [1, 1000], got {args.steps}")
        if not (math.isfinite(args.scale) and 0 < args.scale <= 8):
            raise CLIError(f"--scale must be in (0, 8], got {args.scale:g}")
        if args.plot is not None:
            _check_plot_path(args.plot)
        if args.loss_steps is not None and not args.memory:
            raise CLIError("--loss-steps goes with --memory (amp-backends bench --memory --loss-steps N)")
        loss_steps = 200 if args.loss_steps is None else args.loss_steps
        if loss_steps < 0:
            raise CLIError(f"--loss-steps must be >= 0, got {loss_steps}")
        if args.memory:
            from .bench_memory import main as memory_main

            size = "full" if args.size == "auto" else args.size
            return memory_main(args.backend, list(dict.fromkeys(models)), size, args.scale, loss_steps, args.json)
        from .bench import main as bench_main

        return bench_main(args.backend, list(dict.fromkeys(models)), args.size, args.rounds, warmup, args.scale,
                          args.json, args.plot, args.steps)
    if args.command == "check":
        from .check import main as check_main

        if args.plan:
            from .check import plan_main

            return plan_main(args.target, args.backend, args.dtype, args.size,
                             0.05 if args.budget is None else args.budget, args.emulate, args.save, args.json)
        if args.save or args.emulate or args.budget is not None:
            raise AmpBackendsError("--save, --emulate and --budget go with --plan (amp-backends check --plan TARGET ...)")
        return check_main(args.target, args.backend, args.dtype, args.size, args.policy, args.loss_scale, args.json,
                          fp8=args.fp8)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
