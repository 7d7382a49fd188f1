"""Command line: ``jaxstream run CONFIG [key=value ...] [--out DIR] [--resume] [--plugin MODULE]``.

Subcommands:
  run      run an experiment file (any registered ``kind:``) and write a run directory.
  compare  print the arms of several run directories side by side and write one plot.
  plan     (when the streaming package is installed) plan batch sizes for streamed layers.

Overrides and flags may come in any order. A user error (missing or broken config file, bad
value, unusable ``--out``) prints one line ``error: ...`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

RUN_USAGE = ("jaxstream run CONFIG [key=value ...] [--out DIR] [--resume | --rollback] "
             "[--plugin MODULE] "
             "[--tensorboard] [--profile DIR] [--print-config]")


class UserError(Exception):
    """A mistake in the command line or the config file: one line, exit status 2."""


def add_run_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``run`` subcommand."""
    p = subparsers.add_parser(
        "run", help="run an experiment YAML and write a run directory", usage=RUN_USAGE,
        description="Run an experiment. Overrides are dotted key=value pairs, values parsed as "
                    "YAML (e.g. steps=100 arms.0.lr=3e-3 model.width=128); they may come before "
                    "or after the flags.")
    p.add_argument("config", nargs="?", help="experiment YAML, e.g. experiments/quickstart.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--out", default=None,
                   help="run directory (default: runs/<config name>, suffixed _2, _3... if taken)")
    resume = p.add_mutually_exclusive_group()  # a run is either resumed or rolled back
    resume.add_argument("--resume", action="store_true",
                        help="continue the run in --out (default: the latest runs/<config "
                             "name>*, the highest _N) from its last checkpoints")
    resume.add_argument("--rollback", action="store_true",
                        help="continue a run in --out that diverged from its last sane state (a "
                             "layer store's last commit that passed its divergence guard; "
                             "locally, the last checkpoint before the divergence); the arms' lr "
                             "may change, recorded in metrics.jsonl. Refused on a run that did "
                             "not diverge (use --resume)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (it registers datasets, models, optimizers, engines "
                        "or kinds); repeatable. Installed packages can use the entry-point group "
                        "'jaxstream.plugins' instead")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard event files to RUN_DIR/tensorboard")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="write a jax.profiler trace of the whole run to DIR (open it with "
                        "TensorBoard's profile plugin or Perfetto): every streamed step, read, "
                        "unit, host update, write and commit is annotated")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (every default filled in, overrides applied) "
                        "as YAML and exit: nothing is run or written")
    p.set_defaults(func=main_run, intermixed=True)
    return p


def add_compare_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``compare`` subcommand."""
    p = subparsers.add_parser(
        "compare", help="print the arms of several runs side by side and write one plot",
        description="Compare train runs: one table of every arm, and a plot of test accuracy "
                    "and loss against steps and against training time.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories")
    p.add_argument("--plot", default="compare.png", help="plot path (default: compare.png)")
    p.add_argument("--markdown", action="store_true",
                   help="print a Markdown table with the command and machine (for docs/)")
    p.set_defaults(func=main_compare)
    return p


def check_run_args(args: argparse.Namespace) -> None:
    """The errors that need no config parsing: missing file, ``--out`` at a file."""
    if args.config is None:
        raise UserError("missing CONFIG, the experiment file; usage: " + RUN_USAGE)
    if "=" in args.config and not Path(args.config).exists():
        raise UserError(f"the first argument must be the experiment file, got {args.config!r}; "
                        "usage: " + RUN_USAGE)
    path = Path(args.config)
    if not path.is_file():
        what = ("is a directory" if path.is_dir() else "does not exist" if not path.exists()
                else "is not a regular file (a device, pipe or socket): give a YAML file")
        raise UserError(f"config file {args.config} {what}")

    from jaxstream.experiment.config_yaml import check_file, load_yaml

    check_file(path)
    with path.open() as fh:  # a stream, so YAML errors carry the file name and line
        try:
            load_yaml(fh)
        except RecursionError:
            raise UserError(f"{path}: nested deeper than YAML can read") from None
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out} is a file; give a directory (new or empty, or the run "
                        "to --resume)")
    if args.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise UserError("--tensorboard needs the tensorboardX package: pip install tensorboardX "
                        "(or pip install 'jaxstream[tensorboard]'); nothing was run")


@contextlib.contextmanager
def profiled(trace_dir: str | None) -> Iterator[None]:
    """A ``jax.profiler`` trace of the block into ``trace_dir`` (nothing when None)."""
    if trace_dir is None:
        yield
        return
    import jax

    with jax.profiler.trace(trace_dir):
        yield
    print(f"profile: {trace_dir} (tensorboard --logdir {trace_dir}, or Perfetto)", flush=True)


def main_run(args: argparse.Namespace) -> int:
    """Run ``args.config``; print the run directory (and a headline table if the run has one)."""
    check_run_args(args)
    from jaxstream.experiment.registry import load_plugins
    from jaxstream.experiment.runner import run_experiment

    load_plugins(extra=args.plugin)
    if args.print_config:
        from jaxstream.experiment.config import dump_yaml
        from jaxstream.experiment.registry import load_experiment

        kind, cfg = load_experiment(args.config, args.overrides)
        print(dump_yaml(cfg, {"kind": kind}), end="")
        return 0
    live: list = []

    def follow(run_dir: Path) -> None:  # --tensorboard: events written while the run trains
        from jaxstream.experiment.tensorboard import LiveEvents

        live.append(LiveEvents(run_dir).start())
        print(f"tensorboard: tensorboard --logdir {live[0].out}", flush=True)

    if args.profile is not None and Path(args.profile).exists() and not Path(args.profile).is_dir():
        raise UserError(f"--profile {args.profile} is a file; give a directory for the trace")
    try:
        with profiled(args.profile):
            run_dir, _ = run_experiment(args.config, args.overrides, out=args.out,
                                        resume=args.resume, rollback=args.rollback,
                                        on_start=follow if args.tensorboard else None)
    finally:
        for events in live:  # also when the run fails: its curves so far are kept
            events.close()
    headline = Path(run_dir) / "headline.txt"
    if headline.is_file():
        print(headline.read_text().rstrip())
    print(f"run directory: {run_dir}")
    return 0


def main_compare(args: argparse.Namespace) -> int:
    """Print the arms of ``args.run_dirs`` side by side and write the comparison plot."""
    from jaxstream.experiment.doctable import compare_runs

    for d in args.run_dirs:
        if not (Path(d) / "metrics.jsonl").is_file():
            raise UserError(f"{d} is not a run directory (no metrics.jsonl)")
    print(compare_runs(args.run_dirs, plot=args.plot, markdown=args.markdown))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``jaxstream`` argument parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="jaxstream",
        description="jaxstream: forward-gradient training experiments. "
                    "Example: jaxstream run experiments/quickstart.yaml steps=100")
    from jaxstream import __version__

    parser.add_argument("--version", action="version", version=f"jaxstream {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{run,compare,plan}")
    add_run_parser(sub)
    add_compare_parser(sub)
    from jaxstream.experiment.plan_cli import add_plan_parser

    add_plan_parser(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; a subcommand with positional lists accepts flags anywhere."""
    argv = list(argv)
    if argv and argv[0] in ("run",):
        sub = _subparser(parser, argv[0])
        args = sub.parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def user_error_line(e: BaseException) -> str | None:
    """One line for the errors a user makes (None for anything else: a bug, with traceback)."""
    import yaml

    from jaxstream.experiment.checkpoints import CheckpointError
    from jaxstream.experiment.config import ConfigError
    from jaxstream.stream.errors import StoreError

    if isinstance(e, (UserError, ConfigError)):
        return str(e)
    if isinstance(e, (StoreError, CheckpointError)):  # a store or checkpoint that is damaged,
        return f"{type(e).__name__}: {e}"  # locked or missing
    if isinstance(e, yaml.YAMLError):
        mark = getattr(e, "problem_mark", None)
        where = f"{mark.name}:{mark.line + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if isinstance(e, yaml.constructor.ConstructorError) and "tag" in problem:
            tag = problem.split(" for the tag ")[-1].strip(" '").replace("tag:yaml.org,2002:", "!!")
            return (f"{where}{tag}: tags that build "
                    "Python objects are not allowed in experiment files (plain YAML only)")
        return f"{where}YAML syntax error: {problem}"
    if isinstance(e, OSError) and e.errno is not None:  # the machine's, not a bug: a full
        where = f": {e.filename}" if e.filename else ""  # disk, a read-only or missing path
        return f"{e.strerror or type(e).__name__}{where}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxstream`` command; user errors exit with status 2."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        parser.print_usage(sys.stderr)
        print("error: choose a command, e.g. jaxstream run experiments/quickstart.yaml",
              file=sys.stderr)
        return 2
    args = parse(parser, argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        line = user_error_line(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
