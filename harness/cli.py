"""``loopbench``: the command line (the console script of pyproject.toml; ``python -m loopbench`` too).

    loopbench bench [--config-name PRESET] [-m] [KEY=VALUE ...]   measure, check, bundle, audit, table
    loopbench plan  [--config-name PRESET] [-m] [KEY=VALUE ...]   validate and show the plan; writes nothing
    loopbench audit BUNDLE                                        re-audit a bundle
    loopbench show BUNDLE | --all                                 a bundle's tables, or one line per bundle
    loopbench compare A B                                         tokens/s change of bundle B against A
    loopbench finish BUNDLE                                       publish a bundle whose controller died

``--quiet`` (before or after the subcommand) silences progress lines (``harness/progress.py``).
Exit statuses (``EXIT_STATUS``) are the same for every subcommand.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from . import progress

EXIT_STATUS = """exit status:
  0  done: the run is complete and its audit passes (bench, audit); the plan is valid (plan); printed (show, compare)
  1  an audit found a discrepancy, an error, or (compare) the bundles are not comparable
  2  bad configuration or usage, named in one line before anything is measured or written
  3  the run or bundle is incomplete (stopped, failed child, not yet published; or its audit was interrupted): no
     verdict, and nothing else wrong"""

FINISH_STATUS = """exit status:
  3  published as incomplete: a child was lost with the controller that died (the usual case)
  0  published complete and its audit passes: every child had ended, only the publishing failed (a full disk)
  1  refused, naming why: published already, a controller or child still holds it, other code measured it, or a
     file it needs is damaged; nothing was changed
  2  usage: no bundle at BUNDLE"""

RUN_EPILOG = """examples:
  loopbench bench --config-name cpu-smoke pairs=6
  loopbench bench --config-name cpu-smoke -m order_seed=0,1     # a sweep: one bundle per value
  loopbench plan --config-name ouro-1.4b pairs=9

Without --config-name the preset is ouro-1.4b where CUDA is available, else cpu-smoke.
$LOOPBENCH_CACHE (default ~/.cache/loopbench; the key cache_dir outranks it) holds synthetic
checkpoints and frozen references; a reference is reused when its inputs hash the same
(reuse_references=false captures it again)."""


def _run_parser(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    from . import conf, keys

    p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=f"{RUN_EPILOG}\n\n{keys.help_text()}\n\n{EXIT_STATUS}")
    p.add_argument("--config-name", "-cn", dest="config_name", metavar="PRESET",
                   help=f"preset of configs/ ({', '.join(conf.presets())})")
    sweep = "of KEY=A,B overrides and of the preset's own hydra.sweeper.params"
    p.add_argument("-m", "--multirun", action="store_true",
                   help=f"Hydra multirun: one benchmark per combination {sweep}, each into its own bundle"
                   if name == "bench" else f"the plan of each job of a multirun: one per combination {sweep}")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (keys below)")
    if name == "bench":   # declared so that their values are not taken for overrides, wherever they are written
        hydra = p.add_argument_group("Hydra's flags (show the composed config: nothing runs, our rules are not "
                                     "applied)")
        hydra.add_argument("--cfg", "-c", choices=("job", "hydra", "all"), help="print the config")
        hydra.add_argument("--package", "-p", help="the package of the config --cfg prints")
        hydra.add_argument("--resolve", action="store_true", help="resolve interpolations in what --cfg prints")
        hydra.add_argument("--info", "-i", nargs="?", const="all", metavar="WHAT",
                           choices=("all", "config", "defaults", "defaults-tree", "plugins", "searchpath"),
                           help="Hydra's information (all, config, defaults, defaults-tree, plugins, searchpath)")
    return p


_HYDRA_PASS_ON = ("--hydra-help", "--version")   # Hydra's flags that bench passes on undeclared


def _hydra_flags(args) -> list[str]:
    """The Hydra flags ``bench``'s parser took (:func:`_run_parser`), as Hydra's own parser takes them."""
    flags = [f"--{key}={getattr(args, key)}" for key in ("cfg", "package", "info") if getattr(args, key, None)]
    return flags + (["--resolve"] if getattr(args, "resolve", False) else [])


def build_parser() -> argparse.ArgumentParser:
    """The ``loopbench`` parser and its subcommands."""
    parser = argparse.ArgumentParser(prog="loopbench", description="Auditable A/B evidence for looped-LM inference.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXIT_STATUS)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines or bars (for scripts)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _run_parser(sub, "bench", "run the paired benchmark: references, arms, checks, bundle, audit, table")
    _run_parser(sub, "plan", "validate a configuration and print its plan; creates nothing")
    for name, what, epilog in (
            ("audit", "audit a bundle with the independent auditor (writes its audit.json)", EXIT_STATUS),
            ("finish", "publish the bundle of a controller that died or could not write it", FINISH_STATUS)):
        p = sub.add_parser(name, help=what, description=what, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("bundle", type=Path, metavar="BUNDLE")
    p = sub.add_parser("show", help="a bundle's result tables, or one line per bundle with --all",
                       description="a bundle's result tables and status, or (--all) one line per bundle: folder, "
                                   "the plan's name, model, status and audit, code SHA, headline speedups", epilog=EXIT_STATUS,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path, nargs="?", metavar="BUNDLE")
    p.add_argument("--all", action="store_true", help="every bundle of --results")
    p.add_argument("--results", type=Path, default=None, metavar="DIR", help="bundles folder (default: results/)")
    p = sub.add_parser("compare", help="tokens/s change of bundle B against bundle A, per point and arm",
                       description="per point and arm, the change of B's median tokens/s against A's with a "
                                   "bootstrap interval from both bundles' measured runs (pyperf compare_to style), "
                                   "or 'not comparable' naming the plan fields that differ (model, checkpoint, "
                                   "workload, prompts, exit policy, warmup)", epilog=EXIT_STATUS,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path, metavar="A")
    p.add_argument("b", type=Path, metavar="B")
    p.add_argument("--confidence", type=float, default=None,
                   help="interval level (default: A's verdict.confidence)")
    return parser


def _preset(config_name: str | None) -> str:
    from .bench import default_config_name

    if config_name is not None:     # `--config-name ""` is a preset name too (an unknown one), not the default
        return config_name
    name = default_config_name()
    progress.say("preset", f"{name} ({'CUDA available' if name == 'ouro-1.4b' else 'no CUDA'})")
    return name


def _no_bundle(command: str, path: Path) -> int | None:
    """The one refusal of a path that is no bundle, for every command given one (audit, finish, show, compare):
    no folder there, or a folder without ``plan.json``, is named on stderr and gives exit status 2 (usage),
    before anything is read or written; None when ``path`` is a bundle (published or not). Raises nothing."""
    if not path.is_dir():
        why = f"no bundle folder at {path}"
    elif not (path / "plan.json").is_file():
        why = f"{path} is not a bundle (no plan.json); "
        if any((sub / "plan.json").is_file() for sub in path.iterdir() if sub.is_dir()):   # a folder of bundles
            why += f"it holds bundles: `loopbench show --all --results {path}` lists them"
        else:
            why += "a folder that a run made and left without one holds nothing measured"
    else:
        return None
    print(f"loopbench {command}: {why}", file=sys.stderr)
    return 2


def _unpublished(command: str, path: Path) -> int | None:
    """The one answer to a bundle not yet published (a ``plan.json``, no ``manifest.json``), for every command that
    reads a published one (audit, show, compare): named on stderr with how to publish it, exit status 3, before
    anything is read or written; None when ``path`` is published. 3 and not 2: the bundle is real and the command
    right, but its run is incomplete (stopped, or its controller died), which is what 3 means (EXIT_STATUS).
    Published means the manifest, as ``finish`` and ``show --all`` read it: publishing writes it last and a resume
    removes it first (``evidence.finalize``, ``evidence.unpublish``), so a ``summary.json`` without one is a
    publication cut short, which ``finish`` completes."""
    from .compare import is_published, unpublished_hint

    if is_published(path):
        return None
    print(f"loopbench {command}: {path} is not published (no manifest.json): nothing to {command} yet"
          + unpublished_hint(path), file=sys.stderr)
    return 3


def _bad(exc: Exception, where: str = "") -> int:
    cause = f" ({str(exc.__cause__).splitlines()[0]})" if exc.__cause__ and str(exc.__cause__) else ""
    from .conf import plain_error

    text = plain_error(" ".join(f"{exc}{cause}".split()))   # Hydra's messages span lines; ours is one
    print(f"loopbench: bad configuration{where}: {text}", file=sys.stderr)
    return 2


def _import_libraries() -> None:
    """torch, triton, Hydra and pandas, which bench and plan load anyway, loaded at once with stops held
    (executors.stops_held: a Ctrl-C inside triton's native initialisation aborted the interpreter)."""
    from .executors import stops_held

    with stops_held():
        import hydra, pandas, torch, triton  # noqa: F401, E401


def _bench(args, extra: list[str]) -> int:
    from . import bench, conf, planning

    from .executors import stops_at_once

    name = _preset(args.config_name)
    jobs, runs = 0, None
    with stops_at_once():   # nothing is written while the configuration is checked: SIGTERM too ends it (main)
        if args.multirun:   # every job's config is checked before the first one runs
            try:
                runs = planning.sweep_arm_runs(name, args.overrides, warn=True)
            except planning.SweepError as exc:
                return _bad(exc.cause, exc.where + planning.preset_holding(name, exc.cause))
            jobs = len(runs)
            progress.say("sweep", f"{jobs} jobs, every configuration valid")
        else:     # a key Hydra refuses gets the same one line and exit 2 as our own checks
            try:
                if extra:   # Hydra's flags (--cfg job...): composition only, so a config breaking a rule can be shown
                    conf.compose(name, args.overrides)
                else:
                    planning.check(name, args.overrides, planning.warn_on_stderr())
            except planning.CONFIG_ERRORS as exc:
                return _bad(exc, planning.preset_holding(name, exc))
    return bench.run_hydra(name, [*(["-m"] if args.multirun else []), *args.overrides, *extra], jobs, runs)


def _plan(args) -> int:
    from . import planning

    name = _preset(args.config_name)
    try:
        jobs = planning.check_sweep(name, args.overrides) if args.multirun else [args.overrides]
        texts = []
        for i, job in enumerate(jobs):
            try:
                texts.append(planning.plan_text(name, job))
            except planning.CONFIG_ERRORS as exc:   # a refused resume= names the job too, as check_sweep's refusals
                if not args.multirun:
                    raise
                raise planning.SweepError(planning.job_name(i, jobs), exc) from exc
        if args.multirun:   # which job each plan is, as a refusal names it
            texts = [f"sweep job {job}:\n{text}" if (job := planning.job_name(i, jobs)) else text
                     for i, text in enumerate(texts)]
    except planning.SweepError as exc:
        return _bad(exc.cause, exc.where + planning.preset_holding(name, exc.cause))
    except planning.CONFIG_ERRORS as exc:
        return _bad(exc, planning.preset_holding(name, exc))
    print("\n\n".join(texts))
    return 0


def _show(args) -> int:
    from . import compare

    if args.all == (args.bundle is not None):
        print(f"loopbench show: give a BUNDLE or --all{', not both' if args.all else ''}", file=sys.stderr)
        return 2
    if args.all:
        from .executors import REPO_ROOT

        results = args.results or REPO_ROOT / "results"
        if not Path(results).is_dir():
            print(f"loopbench show: --results {str(results)!r} is not a folder", file=sys.stderr)
            return 2
        dirs = compare.bundle_dirs(results)
        print("\n".join(compare.bundle_line(d) for d in dirs) if dirs else f"no bundles in {results}")
        return 0
    if (status := _no_bundle("show", args.bundle) or _unpublished("show", args.bundle)) is not None:
        return status
    try:
        print(compare.show_text(compare.Bundle.load(args.bundle)))
    except ValueError as exc:
        print(f"loopbench show: {exc}", file=sys.stderr)
        return 2
    except compare.DAMAGE as exc:
        return _damaged("show", [args.bundle], exc)
    return 0


def _damaged(command: str, paths: list[Path], exc: Exception) -> int:
    """One line for a bundle whose documents lack what ``command`` reads (a hand-edited or damaged bundle), exit 2
    as any bundle it cannot read: the auditor names every discrepancy, so the line points at it."""
    which = " or ".join(map(str, paths))
    print(f"loopbench {command}: cannot read {which}: a document lacks or mistypes a field ({exc.__class__.__name__}: "
          f"{exc}); `loopbench audit BUNDLE` names what is wrong", file=sys.stderr)
    return 2


def _compare(args) -> int:
    from . import compare

    if args.confidence is not None and not 0 < args.confidence < 1:
        print(f"loopbench compare: --confidence {args.confidence} is not a level between 0 and 1 (0.95 for a 95% "
              "interval)", file=sys.stderr)
        return 2
    for check in (_no_bundle, _unpublished):     # a path that is no bundle (usage, 2) is named before one unpublished
        for path in (args.a, args.b):
            if (status := check("compare", path)) is not None:
                return status
    try:
        text, comparable = compare.compare_text(compare.Bundle.load(args.a), compare.Bundle.load(args.b),
                                                args.confidence)
    except ValueError as exc:
        print(f"loopbench compare: {exc}", file=sys.stderr)
        return 2
    except compare.DAMAGE as exc:
        return _damaged("compare", [args.a, args.b], exc)
    if Path(args.a).resolve() == Path(args.b).resolve():
        print("loopbench compare: A and B are the same bundle, so every change below is zero by construction (two "
              "bundles of one commit show the noise between runs)", file=sys.stderr)
    print(text)
    return 0 if comparable else 1


def _sigterm_as_ctrl_c():
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does, from the command's first line on: the stages that handle a
    stop (``executors.stops_held`` / ``stops_at_once`` / ``StopSignals``) install their own handlers and put this one
    back, and anywhere else a SIGTERM ends the command as a Ctrl-C does (:func:`main`: one line, exit 3). Without it
    a SIGTERM before the first of those (building the parser, choosing the preset: about the first 0.2 s of
    ``loopbench bench``, and all of ``plan``, ``show``, ``compare``, ``audit`` outside them) killed the command
    silently with status 143. A SIGTERM ignored on entry (SIG_IGN) stays ignored; outside the main thread
    (``cli.main`` called by a test's thread) nothing changes. Returns the handler to put back when the command
    ends (:func:`main`), None where it changed nothing."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        return signal.SIG_DFL
    return None


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand; returns the exit status."""
    previous = None
    try:
        previous = _sigterm_as_ctrl_c()
        status = _main(argv)
        sys.stdout.flush()      # a pipe's buffer is written here, inside the try, not at the interpreter's exit
        return status
    except KeyboardInterrupt:
        # Ctrl-C where no stage handled it (checking the configuration before Hydra runs, plan, show, compare): one
        # line; 3, a stopped command (a run's own stops are handled where they land: controller, bench.show)
        print("\nloopbench: interrupted", file=sys.stderr)
        return 3
    except BrokenPipeError:
        # The reader of stdout went away (`loopbench show --all | head -1`): stop without a traceback. stdout now
        # points at /dev/null so that the interpreter's own flush at exit cannot fail again (Python's docs, "Note
        # on SIGPIPE"); 1, as Python itself exits on EPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        if previous is not None:    # the caller's (a test calling main in-process) SIGTERM as it was
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--quiet" in argv or "-q" in argv:   # anywhere, so that `loopbench bench -q` and `loopbench -q bench` agree
        argv = [a for a in argv if a not in ("--quiet", "-q")]
        os.environ[progress.QUIET_ENV] = "1"   # the children inherit it
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in ("bench", "plan"):   # overrides after -m land in extra: they are overrides all the same
        args.overrides += [a for a in extra if not a.startswith("-")]   # (~key deletions too; flags' values are
        extra = [a for a in extra if a.startswith("-")]                 # taken by the flags bench declares)
    # bench declares the Hydra flags it passes on (--cfg job, ...); of the rest, only those that show Hydra's help or
    # version and run nothing. Anything else (a misspelt --confg-name, --pairs 3 for pairs=3) is named here, before
    # its value could be taken for a malformed override.
    passed_on = [a for a in extra if args.command == "bench" and a in _HYDRA_PASS_ON]
    if unknown := [a for a in extra if a not in passed_on]:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in ("bench", "plan"):
        _import_libraries()
    if args.command == "bench":
        # Hydra runs one mode a call and raises a ValueError for two; --hydra-help would apply the overrides to
        # Hydra's help config (a traceback for any key of ours): both named here in one line instead
        modes = [flag for flag, given in (("-m", args.multirun), ("--cfg", args.cfg), ("--info", args.info)) if given]
        if len(modes) > 1:
            parser.error(f"{' and '.join(modes)} cannot be combined: -m runs the jobs, --cfg and --info only show "
                         "the composed config (one of them a call)")
        if "--hydra-help" in passed_on and args.overrides:
            parser.error(f"--hydra-help shows Hydra's help and takes no overrides (got {' '.join(args.overrides)}); "
                         "`loopbench bench --cfg job KEY=VALUE ...` shows the config they compose")
        return _bench(args, _hydra_flags(args) + passed_on)
    if args.command == "plan":
        return _plan(args)
    if args.command in ("audit", "finish"):
        if (status := _no_bundle(args.command, args.bundle)) is not None:   # before the auditor writes audit.json
            return status
        if args.command == "audit" and (status := _unpublished("audit", args.bundle)) is not None:
            return status
        if args.command == "finish":
            from .bench import finish_main

            try:
                return finish_main([str(args.bundle)])
            except KeyboardInterrupt:   # while publishing (a stop during its audit is bench.show's): nothing is lost
                print(f"\nloopbench finish: interrupted before {args.bundle} was published; nothing measured was lost: "
                      f"run `loopbench finish {args.bundle}` again", file=sys.stderr)
                return 3
        from .controller import audit

        try:
            return audit(args.bundle)
        except KeyboardInterrupt:
            print(f"\nloopbench audit: interrupted; no verdict was written for {args.bundle}", file=sys.stderr)
            return 3
    return _show(args) if args.command == "show" else _compare(args)


if __name__ == "__main__":
    sys.exit(main())
