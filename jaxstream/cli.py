"""Command line: ``jaxstream run experiments/X.yaml key=value ... [--resume] [--out DIR]``.

Subcommands:
  run    run an experiment file (any registered ``kind:``) and write a run directory.
  plan   (when the streaming package is installed) plan batch sizes for streamed layers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def add_run_parser(subparsers: argparse._SubParsersAction) -> None:
    """The ``run`` subcommand."""
    p = subparsers.add_parser(
        "run", help="run an experiment YAML and write a run directory",
        description="Run an experiment. Overrides are dotted key=value pairs, values parsed as "
                    "YAML (e.g. steps=100 arms.0.lr=3e-3 model.width=128).")
    p.add_argument("config", help="experiment YAML, e.g. experiments/quickstart.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--out", default=None,
                   help="run directory (default: runs/<config name>, suffixed _2, _3... if taken)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out (default: the latest runs/<config name>*) "
                        "from its last checkpoints")
    p.set_defaults(func=main_run)


def main_run(args: argparse.Namespace) -> int:
    """Run ``args.config``; print the run directory."""
    from jaxstream.experiment.runner import run_experiment

    run_dir, _ = run_experiment(args.config, args.overrides, out=args.out, resume=args.resume)
    print(f"run directory: {run_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``jaxstream`` argument parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="jaxstream",
        description="jaxstream: forward-gradient training experiments. "
                    "Example: jaxstream run experiments/quickstart.yaml steps=100")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_parser(sub)
    # Subcommands of optional packages register here when those packages are present.
    try:
        from jaxstream.stream.plan_cli import add_plan_parser
    except ModuleNotFoundError as e:
        if e.name not in ("jaxstream.stream", "jaxstream.stream.plan_cli"):
            raise
    else:
        add_plan_parser(sub)  # sets func=main_plan on its parser
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxstream`` command; config errors exit with status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        from jaxstream.stream.plan_cli import main_plan

        func = main_plan
    from jaxstream.experiment.config import ConfigError

    try:
        return int(func(args) or 0)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
