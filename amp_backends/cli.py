"""The ``amp-backends`` command: ``info``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="amp-backends", description="Mixed precision on every PyTorch device.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="list backends: available or why not, dtypes, kernel, plugin")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.add_argument("-v", "--verbose", action="store_true", help="also list every plugin")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "info":
        from . import info

        return info.main(as_json=args.json, verbose=args.verbose)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
