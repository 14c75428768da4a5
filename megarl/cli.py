"""``megarl train|convert|report`` — parses, then calls; nothing else.

``megarl train`` loads and checks the config, then starts as the launcher (checkpoint choice,
every row of the data, torchrun with ``parallel.tensor_parallel × pipeline_parallel ×
data_parallel`` ranks) or, under torchrun, as a trainer rank: the two halves of ``megarl.start``.

A failure the user can fix (:class:`megarl.errors.MegarlError`) ends as one line on stderr,
``megarl: <kind> error: <message>``, and exit code 2, printed once: by rank 0, or by the
launcher for ranks it started. Anything else is a bug and keeps its traceback.

Under a torchrun started by hand with a number of processes the config does not ask for, each
rank says so before its heavy imports (:func:`_wrong_world_size`): each machine's local rank 0
prints the line and exits 2; the other ranks wait for torchrun to stop them, so none can end
first and have torchrun stop local rank 0 before its line is out. torchrun's own failure report
follows unless it was started as ``python -m megarl.launcher`` (torchrun's arguments, one line).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import time

EXIT_USER_ERROR = 2
"""Exit code of a failure the user can fix (bad config, data, checkpoint, engine address)."""
PEER_WAIT_S = 120.0
"""How long a rank other than local rank 0 waits, on a wrong world size, for torchrun to stop it."""


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[megarl r{rank} %(asctime)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("megatron", "vllm"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def cmd_train(args: argparse.Namespace) -> int:
    """Load and check the config, then start as the launcher or as a rank (``megarl.start``)."""
    from megarl.config import load_config

    cfg = load_config(args.config, args.set)
    if args.print_config:
        from megarl.config.docs import explain

        sys.stdout.write(explain(cfg) + "\n")
        return 0
    from megarl.prelaunch import check_run
    from megarl.start import launch, rank

    p = cfg.parallel
    check_run(cfg, p.tensor_parallel * p.pipeline_parallel * p.data_parallel)  # before any process group starts
    return rank(cfg) if "RANK" in os.environ else launch(cfg, args.config, args.set or [])


def _wrong_world_size(argv: list[str]) -> int | None:
    """A torchrun rank of ``megarl train``, before torch and Megatron are imported (~10 s): the
    exit code when WORLD_SIZE is not what the config asks for, else None (and a config that
    does not load is left to :func:`main` to report).

    Local rank 0 prints the line (or hands it to the megarl launcher) and returns 2. The other
    ranks print nothing and wait for torchrun to stop them (SIGTERM, which nothing handles
    yet): had one of them exited first, torchrun would stop local rank 0, perhaps before its
    line was out, and name that rank as the failure."""
    from megarl.config import load_config
    from megarl.errors import ConfigError, MegarlError

    if argv[:1] != ["train"]:
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # (a usage error: main() prints it)
            args = _parser().parse_args(argv)
        cfg = load_config(args.config, args.set)
    except (SystemExit, MegarlError):
        return None
    from megarl.start import world_size_error

    message = None if args.print_config else world_size_error(cfg)
    if message is None:
        return None
    if int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) != 0:
        time.sleep(PEER_WAIT_S)
        return EXIT_USER_ERROR
    return _user_error(ConfigError(message), local=True)


def cmd_report(args: argparse.Namespace) -> int:
    from megarl.report import draw

    page = draw(args.run_dir, args.out, args.sweep)
    logging.getLogger("megarl").info("wrote %s", page)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run a command; a :class:`~megarl.errors.MegarlError` becomes one line and exit code 2."""
    from megarl.errors import MegarlError

    _setup_logging()
    try:
        return _dispatch(list(sys.argv[1:] if argv is None else argv))
    except MegarlError as e:
        return _user_error(e)
    except Exception:
        from megarl.launcher import peer_reported

        if peer_reported():  # another rank failed first and said why; this is its consequence
            return EXIT_USER_ERROR
        raise


def _user_error(e: Exception, local: bool = False) -> int:
    """Print ``megarl: <kind> error: <message>`` once: on rank 0 under torchrun (``local``: on
    each machine's local rank 0), or handed to the megarl launcher (which prints the first
    rank's line) when it started this rank."""
    from megarl.launcher import record_rank_error

    message = " ".join(line.strip() for line in getattr(e, "message", str(e)).splitlines() if line.strip())
    line = f"megarl: {getattr(e, 'kind', 'megarl')} error: {message}"
    rank = os.environ.get("LOCAL_RANK", "0") if local else os.environ.get("RANK", "0")
    if not record_rank_error(line) and int(rank) == 0:
        sys.stderr.write(line + "\n")
    return EXIT_USER_ERROR


def _dispatch(args_list: list[str]) -> int:
    if args_list[:1] == ["convert"]:  # its own parser (tools/convert.py is the same tool)
        from megarl.convert import main as convert
        from megarl.errors import ConvertError

        try:
            return int(convert(args_list[1:]))
        except SystemExit as e:  # the tool's own one-line refusals (argparse's usage errors are ints)
            if isinstance(e.code, str):
                raise ConvertError(e.code) from None
            raise
    args = _parser().parse_args(args_list)
    return int(args.fn(args))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megarl")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser(
        "train",
        help="run RL training",
        description="Run RL training. Settings come from --config and --set; --print-config lists every "
        "setting with its value and meaning.",
    )
    t.add_argument("--config", help="YAML config (examples/*.yaml)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.steps=5")
    t.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (YAML, each setting with its doc) and exit without training",
    )
    t.set_defaults(fn=cmd_train)
    r = sub.add_parser("report", help="plots + HTML page of a run's metrics")
    r.add_argument("run_dir")
    r.add_argument("--out", help="output folder (default RUN_DIR/report)")
    r.add_argument(
        "--sweep",
        metavar="DIR",
        help="a benchmarks/time_to_target.py output folder: also show its sweep's optimum batch and fitted B_crit",
    )
    r.set_defaults(fn=cmd_report)
    sub.add_parser("convert", help="HF <-> megarl checkpoint: hf-to-megarl | megarl-to-hf (megarl convert -h)")
    return ap


if __name__ == "__main__":
    from megarl.compat.exit import exit_now
    from megarl.compat.startup import startup

    if "RANK" in os.environ:  # a trainer rank under torchrun: torch's and Megatron's modules, frozen
        if (refused := _wrong_world_size(sys.argv[1:])) is not None:
            raise SystemExit(refused)
        with startup():
            import megarl.loop  # noqa: F401
    code = main()
    if code == 0:  # a finished rank's or launcher's teardown is seconds of nothing (compat/exit.py)
        exit_now(code)
    # a failing rank leaves the usual way: torchrun stops its peers when the first one exits, so a
    # rank ending at once could cut off rank 0 before it prints the run's one-line error
    raise SystemExit(code)
