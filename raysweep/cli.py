"""`python -m raysweep <command>`: one function per subcommand, each returning an exit code."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from raysweep.errors import RayNotStarted, StoreUnavailable, SweepFailed, UserError

log = logging.getLogger(__name__)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="sweep spec (YAML), e.g. search_spaces/quickstart.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec key, value parsed as YAML (repeatable), e.g. --set train.epochs=2")
    p.add_argument("--address", default=None,
                   help="join a running Ray cluster (e.g. auto), or `local` for a cluster of this driver's own; "
                        "default: $RAY_ADDRESS (`ray job submit` sets it), else the cluster the last `ray start` on "
                        "this machine recorded (as ray.init() finds it), else a local one")
    p.add_argument("-v", "--verbose", action="store_true", help="show Ray's worker and controller logs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raysweep",
        description="Ray Tune sweeps over Ray Train DDP trials for large-batch training, recorded in MLflow.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("tune", help="run the sweep: Tune + ASHA over TorchTrainer trials, recorded in MLflow")
    _common(p)
    p.add_argument("--resume", action="store_true", help="continue an interrupted sweep from storage_path")
    p.add_argument("--progress-every", type=float, default=30.0, metavar="S", help="seconds between progress tables")
    p.add_argument("--cap-batch", type=int, default=None, metavar="N",
                   help="per-GPU batches above N run as micro-batches ≤ N with more accumulation (same global batch)")
    p.add_argument("--confirm", action="store_true",
                   help="then run the sweep's answer on two seeds for its whole budget (as `confirm` does)")
    _fail_above(p)
    p.set_defaults(func=cmd_tune)
    p = sub.add_parser("train", help="run one trial with every searched knob at its `default:`")
    _common(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("probe", help="find the largest per-GPU batch that fits, under the spec's real scaling")
    _common(p)
    p.add_argument("--start", type=int, default=8, help="first per-GPU batch tried (then doubling, then bisection)")
    p.add_argument("--max-batch", type=int, default=65536, help="stop doubling here")
    p.add_argument("--margin", type=float, default=0.1, help="share of device memory kept free in the recommendation")
    p.add_argument("--max-memory-gb", type=float, default=None,
                   help="CPU workers: a batch fits only if its peak RSS stays under this (CPU has no allocator limit)")
    p.add_argument("--noise-scale", default=None, metavar="N|last",
                   help="a gradient noise scale (samples), or `last`: the newest sweep's of this spec's experiment; "
                        "adds the time-to-target table over the batches that fit")
    p.set_defaults(func=cmd_probe)
    p = sub.add_parser("report", help="rebuild a sweep's summary, plots and report.html from the MLflow store alone")
    p.add_argument("spec", nargs="?", default=None, help="the sweep's spec (its experiment, store and storage_path)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec key, as for tune")
    p.add_argument("--experiment", default=None, help="an MLflow experiment name instead of a spec")
    p.add_argument("--tracking-uri", default=None, help="the MLflow store (default: the spec's, else ./mlflow.db)")
    p.add_argument("--out", default=None,
                   help="folder for the files "
                        "(default: <storage_path>/<name>/report, or ./raysweep_report/<experiment>)")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("answer", help="print the newest sweep's answer, or with --batch the predicted recipe for a "
                                      "global batch it did not run (from the MLflow store alone)")
    p.add_argument("spec", help="the sweep's spec (its experiment, store and storage_path)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec key, as for tune")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="a global batch: the recipe the sweep predicts for it (peak LR, weight decay, time)")
    _fitted(p)
    _store(p)
    p.set_defaults(func=cmd_answer)
    p = sub.add_parser("confirm", help="run the newest sweep's answer (or --batch N's prediction) on two seeds for its "
                                       "whole budget, outside ASHA, and print it against the prediction")
    _common(p)
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="confirm the predicted recipe for global batch N instead of the answer")
    p.add_argument("--seeds", default=None, metavar="A,B",
                   help="train.seed of each run (default: the two after the spec's train.seed)")
    p.add_argument("--progress-every", type=float, default=30.0, metavar="S", help="seconds between progress tables")
    _fail_above(p)
    _fitted(p)
    _store(p)
    p.set_defaults(func=cmd_confirm)
    p = sub.add_parser("check", help="validate a spec and print the resolved config and derived values")
    p.add_argument("spec", help="sweep spec (YAML), e.g. search_spaces/quickstart.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec key, as for tune")  # no --address, no -v: check starts no Ray
    p.set_defaults(func=cmd_check)
    return parser


def _fitted(p) -> None:
    p.add_argument("--fitted", action="store_true",
                   help="the answer's batch with the best LR the sweep places there (the checked fit's, else its "
                        "bowl's bottom at that batch) and its weight decay, where that is a better recipe than the "
                        "best trial's")


def _store(p) -> None:
    p.add_argument("--tracking-uri", default=None,
                   help="the MLflow store the sweep is in (default: the spec's mlflow.tracking_uri, else ./mlflow.db), "
                        "e.g. sqlite:///path/to/mlflow.db from another folder")


def _with_store(args) -> list[str]:
    """The overrides, with --tracking-uri as the spec's mlflow.tracking_uri."""
    from raysweep.config import STORE_KEY

    return [*args.overrides, *([f"{STORE_KEY}={args.tracking_uri}"] if args.tracking_uri else [])]


def _fail_above(p) -> None:
    p.add_argument("--fail-above", type=float, default=None, metavar="PCT",
                   help="exit 1 when the confirmation's mean value misses the expected one by more than PCT percent "
                        "(for CI); a confirmation with a seed that did not finish exits 1 with or without it")


def _fail_fraction(args) -> float | None:
    if args.fail_above is not None and not args.fail_above >= 0:
        raise UserError(f"--fail-above {args.fail_above}: expected a percentage of 0 or more, e.g. --fail-above 5")
    return None if args.fail_above is None else args.fail_above / 100


def cmd_tune(args) -> int:
    from raysweep import sweep
    from raysweep.config import load_config

    config = load_config(args.spec, args.overrides)
    fail_above = _fail_fraction(args)
    if fail_above is not None and not args.confirm:
        raise UserError(f"--fail-above {args.fail_above:g}: it judges the confirmation; add --confirm")
    if args.cap_batch is not None and args.cap_batch < 1:
        raise UserError(f"--cap-batch {args.cap_batch}: expected a positive per-GPU batch size")
    args.resumable = config  # a Ctrl-C or a failure from here on: `main` names the command that resumes it
    code = sweep.run(config, address=args.address, resume=args.resume, verbose=args.verbose,
                     progress_every_s=args.progress_every, cap_batch=args.cap_batch)
    args.resumable = None  # the sweep ended: --confirm's runs are new ones, with nothing to resume
    if args.confirm and code == 0:
        from raysweep import confirm

        return confirm.run_with_fitted(config, address=args.address, verbose=args.verbose,
                                       progress_every_s=args.progress_every, cap_batch=args.cap_batch,
                                       fail_above=fail_above)
    return code


def cmd_answer(args) -> int:
    from raysweep import confirm
    from raysweep.config import load_config

    config = load_config(args.spec, _with_store(args), sweep=False, trial=False)  # it reads a store: nothing to train
    return confirm.show(config, args.batch, args.fitted)


def cmd_confirm(args) -> int:
    from raysweep import confirm
    from raysweep.config import load_config

    config = load_config(args.spec, _with_store(args), sweep=False, trial=False)  # its runs are the sweep's spec's
    seeds = None
    if args.seeds is not None:
        try:
            seeds = tuple(int(s) for s in args.seeds.split(","))
        except ValueError:
            raise UserError(f"--seeds {args.seeds!r}: expected whole numbers separated by commas, e.g. --seeds 1,2") \
                from None
        if not seeds or len(set(seeds)) != len(seeds):
            raise UserError(f"--seeds {args.seeds!r}: give distinct seeds, e.g. --seeds 1,2")
    return confirm.run(config, args.batch, seeds, address=args.address, verbose=args.verbose,
                       progress_every_s=args.progress_every, fail_above=_fail_fraction(args), fitted=args.fitted)


def cmd_train(args) -> int:
    from raysweep import sweep
    from raysweep.config import load_config

    config = load_config(args.spec, args.overrides, sweep=False)  # one trial, no ASHA
    return sweep.run(config, single=True, address=args.address, verbose=args.verbose)


def cmd_probe(args) -> int:
    from raysweep import probe
    from raysweep.config import load_config

    config = load_config(args.spec, args.overrides, sweep=False, trial=False)
    return probe.run(config, address=args.address, start=args.start, max_batch=args.max_batch, margin=args.margin,
                     max_memory_gb=args.max_memory_gb, verbose=args.verbose, noise_scale=args.noise_scale)


def cmd_report(args) -> int:
    from raysweep import report

    return report.run(args.spec, args.overrides, args.experiment, args.tracking_uri, args.out)


def cmd_check(args) -> int:
    from raysweep import console, tracking
    from raysweep.asha import AshaPlan, rung_table
    from raysweep.config import load_config
    from raysweep.data import load_data
    from raysweep.data.describe import describe
    from raysweep.data.synthetic import synthetic_cached
    from raysweep.models import check_spec_model
    from raysweep.sweep import static_batch_cap

    config = load_config(args.spec, args.overrides)
    model = check_spec_model(config)  # the model builds and takes a step on the CPU, or one line says why not
    # the data as a sweep reads it (a folder decoded once, then from its cache); a synthetic set not rendered yet is
    # described from the spec alone (rendering 50,000 captchas is the sweep's first minutes, not check's)
    data = None
    if config.data.train_dir is not None or synthetic_cached(config.data):
        data = load_data(config.data, console.progress_printer())
    train_size = len(data.train) if data is not None else config.data.synthetic.train_size
    config.trials.check_data_fits(train_size, static_batch_cap(config, None), source=config.source)
    # the rungs in the other unit need each batch's epoch seconds: what this experiment's trials measured
    uri = tracking.resolve_tracking_uri(config.mlflow.tracking_uri)
    seconds = tracking.in_store(lambda: tracking.epoch_seconds_by_batch(uri, config.experiment_name), uri,
                                config.mlflow.retry_s, "the epochs' seconds")
    console.print_check(config, train_size, (rung_table(AshaPlan.of(config), config.trials.global_batches(), seconds),
                                             seconds), describe(data, config.data.charset) if data else None,
                        model)
    return 0


def main(argv: list[str] | None = None) -> int:
    from raysweep import console
    from raysweep.cluster import recorded_address

    args = build_parser().parse_args(argv)
    args.address, args.verbose = getattr(args, "address", None), getattr(args, "verbose", False)  # report has neither
    if hasattr(args, "address") and not args.address:
        # where Ray's own ray.init() looks, in its order: RAY_ADDRESS (`ray job submit` sets it for its entry
        # point), then the address the last `ray start` on this machine recorded (on a cluster's head): the
        # cluster to join, with the checks a cluster gets (nodes.check_cluster); else a local cluster of its own
        if os.environ.get("RAY_ADDRESS"):
            args.address = os.environ["RAY_ADDRESS"]
        elif recorded := recorded_address():
            args.address = recorded[0]
            console.print_cluster(f"no --address; joining the Ray cluster at {args.address}, which the last "
                                  f"`ray start` on this machine recorded ({recorded[1]}); --address local starts a "
                                  f"cluster of this driver's own")
    if args.address == "local":  # Ray's word for a new local cluster, whatever runs here already
        args.address = None
    if not args.address:
        # Ray reads this when first imported: explicit token auth for the local cluster raysweep starts
        # silences Ray's warning and stays secure; a running cluster keeps the mode it was started with.
        # Not with --address, even when ~/.ray/auth_token exists: Ray writes one on every local start in
        # token mode, and a token-mode driver's actors die on a cluster without token auth (tasks still run)
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    # Tune's new console engine prints its own boxes even at verbose=0; raysweep prints progress itself
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # MLflow sets its loggers up on import from this variable ("Creating initial MLflow database tables...")
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    try:
        return args.func(args)
    except UserError as e:
        print(f"raysweep: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SweepFailed, RayNotStarted) as e:  # SweepFailed: what ran the sweep failed (its
        # broker lost); RayNotStarted: the local Ray did not come up, before anything of the sweep (nothing to resume)
        failed = not isinstance(e, KeyboardInterrupt)
        print(f"raysweep: {f'failed: {e}' if failed else 'interrupted'}{_resume_line(args, e)}", file=sys.stderr)
        return 1 if failed else 130


def _resume_line(args, e: BaseException) -> str:
    """' (resume with: ...)' for a `tune` sweep that Tune saved (not its --confirm, not `train`, `confirm` or `probe`,
    which resume nothing: run them again), else ''."""
    config = getattr(args, "resumable", None)
    if config is None or isinstance(e, RayNotStarted):
        return ""
    from raysweep.resume import resume_hint
    from raysweep.sweep import Where

    try:
        command = resume_hint(Where.of(config, single=False).experiment_path, args.spec, args.overrides)
    except Exception as looked:  # what ended the sweep is the line's news; never a traceback over it
        log.warning("could not look for the sweep to resume: %s", looked)
        return ""
    if not command:
        return ""
    return f" ({'once the store answers, ' if isinstance(e, StoreUnavailable) else ''}resume with: {command})"


if __name__ == "__main__":
    sys.exit(main())
