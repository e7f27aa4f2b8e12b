"""``pagedserve``: the command-line entry point, a parser of subcommands.

Each subcommand is a module exposing ``add_parser(subparsers) -> ArgumentParser`` and
``run(args) -> int``; adding one is one line in :data:`SUBCOMMANDS`. :func:`main` sets
the OpenMP spin (:func:`pagedserve.engine.worker.process_tuning.set_omp_spin`) before anything imports
torch, since libgomp reads it only when torch loads it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: list[tuple[str, str]] = [
    ("serve", "pagedserve.server.serve_cli"),
    ("bench", "pagedserve.server.bench_cli"),
]
"""(name, module) of every subcommand, in ``--help`` order."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="pagedserve: a paged-KV-cache LLM serving engine")
    from pagedserve import __version__

    parser.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for _name, module_name in SUBCOMMANDS:
        module = importlib.import_module(module_name)
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns its exit status."""
    from pagedserve.engine.worker import process_tuning

    process_tuning.set_omp_spin()  # first: the subcommands' modules import torch
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
