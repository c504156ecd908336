"""The ``tf32lab`` command.

Exit codes: 0 success, 1 a check failed, 2 bad input (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tf32lab",
        description=(
            "See, control and choose how float32 matrix math runs on tensor-core hardware "
            "(TF32, bf16) in PyTorch."
        ),
        epilog="Library: import tf32lab; with tf32lab.precision('high'): ...  Docs: README.md, docs/.",
    )
    parser.add_argument("--version", action="version", version=f"tf32lab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    levels = sub.add_parser("levels", help="list the precision levels and what each asks of PyTorch's backends")
    levels.set_defaults(run=_levels)
    return parser


def _levels(_: argparse.Namespace) -> int:
    from .levels import BACKEND_VALUES, LEVELS

    print(f"{'level':<9} {'cuda.matmul':<12} mkldnn.matmul")
    for level in LEVELS:
        cuda, mkldnn = BACKEND_VALUES[level]
        print(f"{level:<9} {cuda:<12} {mkldnn}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
