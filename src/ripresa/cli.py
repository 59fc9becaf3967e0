"""The ``ripresa`` command line. The only place that turns errors into exit codes.

Exit codes (every command): 0 success · 1 a check failed · 2 bad input or the
work could not be completed · 3 ``ripresa train --mirror``: the run ended but its
final generation is not in the mirror (the store could not be reached in time;
``ripresa mirror push RUN`` uploads it: docs/MIRROR.md, "The close"). See
:mod:`ripresa.errors` and docs/FAULTS.md, "Exit codes".
No traceback reaches a user: an exception no check anticipated is reported in
one paragraph with exit 2 (``RIPRESA_DEBUG=1`` re-raises it).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._version import __version__
from .errors import BadInput, RipresaError
from .text import escape_terminal


def print(*values: Any, sep: str = " ", end: str = "\n", file: Any = None, flush: bool = False) -> None:  # noqa: A001
    """Every ``print`` of this module, terminal-safe: a value read from a run folder (a path, a URL, a policy, an
    error quoting a file) prints its control characters as visible escapes (docs/FAULTS.md, "Trust model")."""
    import builtins

    builtins.print(*(escape_terminal(v) for v in values), sep=sep, end=end, file=file, flush=flush)


Handler = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, Handler] = {}
_PARSERS: dict[str, argparse.ArgumentParser] = {}


def _command(sub: argparse._SubParsersAction, name: str, handler: Handler, **parser_kw: Any) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``; ``handler`` runs it."""
    _COMMANDS[name] = handler
    _PARSERS[name] = sub.add_parser(name, **parser_kw)
    return _PARSERS[name]


def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """``ripresa verify ... -- python train.py`` → (ripresa args, trainer command)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


# ----------------------------------------------------------------------------- verify
def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = _command(
        sub, "verify", _cmd_verify,
        help="prove a resume exact: continuous vs interrupted vs resumed vs resumed-without-RNG",
        description="Run a trainer four times in fresh processes and compare the trajectories after the cut. "
        "By default the script (one that uses ripresa's Checkpointer, or a framework integration) runs unchanged and "
        "its Checkpointer is steered through the environment (RIPRESA_VERIFY) into folders under --output, where it "
        "records the trajectory itself: the script's own run folder is never touched. With --contract, a trainer "
        "that follows the contract --steps/--output/--resume/--omit-rng-restore and writes summary.json is run with "
        "those options (docs/VERIFY.md). Without a command after --, the 33-parameter reference exercise is verified "
        "(a contract trainer). With --world-sizes 2,1,4 the command runs under torchrun (gloo), the whole run on the "
        "first world size and resumed segment by segment on the others, and is compared at tolerance 0 with the "
        "uninterrupted run; the negative control is the same change without the world-size-invariant mode "
        "(docs/VERIFY.md, \"Across world sizes\").",
        usage="ripresa verify --output DIR [--steps N] [--cut K | --world-sizes W1,W2,...] [--tolerance T] "
              "[--contract | --steer] [-- python train.py ARGS...]",
    )
    p.add_argument("--output", type=Path, required=True, help="new folder for the four runs and verification.json")
    p.add_argument("--steps", type=int, default=10, help="total updates N (default 10)")
    p.add_argument("--cut", type=int, default=None, help="updates before the interruption K (default 5)")
    p.add_argument("--world-sizes", default=None, metavar="W1,W2,...",
                   help="resume across these rank counts under torchrun, cuts evenly spaced (docs/VERIFY.md, "
                        "\"Across world sizes\"; tolerance 0 by default)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="absolute tolerance (default 1e-12; 0 with --world-sizes)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    p.add_argument("--json", action="store_true", help="print verification.json instead of tables")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--contract", dest="mode", action="store_const", const="contract", default=None,
                     help="the command implements the contract (--steps/--output/--resume/--omit-rng-restore)")
    how.add_argument("--steer", dest="mode", action="store_const", const="steer",
                     help="run the command unchanged and steer its Checkpointer (the default for a command)")


def _cmd_verify(args: argparse.Namespace) -> int:
    from .verify.verify import reference_exercise_command, render_verdict, verify_resume

    if args.world_sizes is not None:
        return _cmd_verify_world(args)
    command = args.trainer or reference_exercise_command()
    mode = args.mode or ("steer" if args.trainer else "contract")  # the reference exercise is a contract trainer
    verdict = verify_resume(command, output=args.output, steps=args.steps, cut=5 if args.cut is None else args.cut,
                            atol=1e-12 if args.tolerance is None else args.tolerance, rtol=args.rtol, mode=mode)
    return _verify_done(args, verdict, render_verdict)


def _cmd_verify_world(args: argparse.Namespace) -> int:
    """``ripresa verify --world-sizes ...`` (verify/world.py): steered only, a command required, evenly spaced cuts."""
    from .verify.world import render_world_verdict, verify_world

    if args.mode == "contract":
        raise BadInput("--world-sizes steers the script's Checkpointer: --contract does not apply",
                       hint="drop --contract (docs/VERIFY.md, \"Across world sizes\")")
    if args.cut is not None:
        raise BadInput("--world-sizes cuts the run evenly: --cut does not apply", found=f"--cut {args.cut}",
                       hint="choose --steps; segment k ends at step k·steps/n (docs/VERIFY.md, \"Across world sizes\")")
    if not args.trainer:
        raise BadInput("--world-sizes needs the trainer command", expected="ripresa verify --world-sizes 2,1,4 ... -- python train.py",
                       found="no command after --")
    verdict = verify_world(args.trainer, output=args.output, world_sizes=args.world_sizes, steps=args.steps,
                           atol=0.0 if args.tolerance is None else args.tolerance, rtol=args.rtol)
    return _verify_done(args, verdict, render_world_verdict)


def _verify_done(args: argparse.Namespace, verdict: Any, render: Callable[[Any], None]) -> int:
    if args.json:
        import json

        print(json.dumps(verdict.report, indent=2, default=str))
    else:
        render(verdict)
        print(f"report: {args.output / 'verification.json'}")
    return verdict.exit_code


# ----------------------------------------------------------------------------- demo
def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "demo", _cmd_demo, help="the main job of `make demo`: the resume proof, then the engine's checkpoint/signal/resume cycle")
    p.add_argument("--output", type=Path, default=None, help="folder to create (default runs/demo-TIMESTAMP)")


def _cmd_demo(args: argparse.Namespace) -> int:
    from .engine.demo import run_demo

    out = args.output or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    return run_demo(out)


# ----------------------------------------------------------------------------- inspect
def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = _command(
        sub, "inspect", _cmd_inspect,
        help="show what a .bin, .safetensors, checkpoint.pt or run folder holds, and whether it is valid",
        description="Inspect an ANDREA .bin (header, size, sidecar, companion, statistics of weights/m/v), "
        "a checkpoint.pt (hash, schema, progress, versions, identities, tensor statistics) or a run folder "
        "(generations, which one a resume uses, LOCK holder, leftover temporaries); a store URL's (s3://, file://) "
        "newest committed generation or --step N's, pulled verified into a temporary folder. Read-only. "
        "Exit 0 valid (a run folder: a resume finds a valid generation), 1 a check failed, 2 bad input.",
        usage="ripresa inspect PATH|URL [--step N] [--json] [--check-finite]\n"
        "                       [--deep | --no-deep] [--require-signature]",
    )
    p.add_argument("path", help="a .bin, a .safetensors, a checkpoint.pt, a step_NNNNNN.dcp folder or a run folder "
                   "(docs/INSPECT.md); or a store URL, s3://bucket/prefix or file:///path: its newest committed "
                   "generation, pulled verified into a temporary folder (docs/MIRROR.md, \"Tools on a generation "
                   "that lives only in the store\")")
    p.add_argument("--step", type=int, help="with a store URL: this generation (default: the newest that verifies)")
    p.add_argument("--json", action="store_true", help="print one JSON document (keys: docs/INSPECT.md) instead of tables")
    p.add_argument("--check-finite", action="store_true", help="fail (exit 1) on NaN/Inf in weights, m, v or any floating tensor")
    p.add_argument(
        "--deep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="read every .bin in full: sha256 against marker and companion, statistics (default); "
        "--no-deep reads only headers, sizes, markers and companions",
    )
    p.add_argument("--require-signature", action="store_true",
                   help="fail (exit 1) on generations without a valid HMAC signature (key: RIPRESA_HMAC_KEY[_FILE])")


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .tools import from_store

    if from_store.is_store_url(args.path):  # a generation that lives only in the store (docs/MIRROR.md)
        if args.require_signature:
            from .io.auth import require_from_cli

            require_from_cli("ripresa inspect --require-signature")  # the pull refuses unsigned generations
        with from_store.pulled(args.path, args.step) as got:
            print(got.line("inspecting"), file=sys.stderr if args.json else sys.stdout)
            args.path, args.require_signature = got.path, False
            return _inspect_local(args, got)
    if args.step is not None:
        raise BadInput("--step needs a store URL", found=f"--step {args.step} with {args.path}",
                       hint="ripresa inspect RUN/step_NNNNNN.* inspects one generation of a run folder")
    args.path = from_store.local_path(args.path, "path")
    return _inspect_local(args)


def _inspect_local(args: argparse.Namespace, got: Any = None) -> int:
    """``ripresa inspect`` on a local path (``got``: a generation pulled from a store, its paths shown as the URL)."""
    from .tools.inspect import error_report, inspect_path, render_report

    if args.require_signature:
        from .io.auth import require_from_cli
        from .store.kinds import check_generation_file

        require_from_cli("ripresa inspect --require-signature")
        if not args.path.is_dir():
            check_generation_file(args.path)
    try:
        report = inspect_path(args.path, check_finite=args.check_finite, deep=args.deep,
                              bin_model=_bin_model(Path(args.path)) if args.deep else None)
    except RipresaError as exc:
        if not args.json:
            raise
        print(f"ripresa inspect: error: {exc}", file=sys.stderr)
        report = error_report(args.path, exc, check_finite=args.check_finite, deep=args.deep)
    if got is not None:
        report = {**got.relabel(report), "store": {"url": got.url, "step": got.step, "bytes": got.bytes,
                                                   "objects": got.objects}}
    if args.json:
        import json

        print(json.dumps(report, indent=2, allow_nan=False))
    else:
        render_report(report)
    return report["exit_code"]


# ----------------------------------------------------------------------------- train
def _add_train(sub: argparse._SubParsersAction) -> None:
    p = _command(
        sub, "train", _cmd_train,
        help="train the ANDREA byte-level GPT with checkpoints, signals, sample audits and a data mixture",
        description="Train the ANDREA byte-level GPT. With --run, resumes automatically from the newest valid "
        "generation, --steps N is the run's end step (the same command after a kill ends where an uninterrupted run "
        "ends; after the end it trains nothing), and a normal end saves the final step. With --output (the "
        "`ripresa verify` contract), --steps counts this process's steps and the folder must not exist. "
        "SIGTERM/Ctrl-C: checkpoint and exit 0; SIGUSR1: checkpoint and continue. With --mirror, exit 3 when the "
        "run ended with its final generation not in the mirror (docs/MIRROR.md).",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run", type=Path, help="run folder (created, or resumed)")
    where.add_argument("--output", type=Path, help="new folder (verification contract)")
    p.add_argument("--config", help="tiny | andrea-12m | andrea-120m | FILE.toml (default: the run's config.json, else tiny)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.lr=1e-3")
    p.add_argument("--source", dest="sources", action="append", default=[], metavar="NAME=PATH", help="add a text file or folder as a data arm")
    p.add_argument("--steps", type=int, help="--run: the step the run ends at, counted from its start, resumes "
                   "included (default train.max_steps; the LR schedule follows train.max_steps, not --steps); "
                   "--output: the steps of this process")
    p.add_argument("--every", type=_every, help="checkpoint cadence in steps (default 100; 0 = signals only), or auto: "
                   "chosen from the measured step time and save cost (Young–Daly, docs/CADENCE.md)")
    p.add_argument("--memory-every", type=int, default=0, metavar="K",
                   help="also keep a complete generation of every K-th step in shared memory (/dev/shm), copied while "
                   "the next step runs: after a crash of the process the same command loses at most K steps "
                   "(default 0: off; single process only; docs/TIERS.md)")
    p.add_argument("--invariant", type=int, default=0, metavar="G",
                   help="world-size-invariant steps: each step is G micro-batches of train.batch_size crops, drawn by "
                   "global index and summed in a fixed tree, so 1, 2 or 4 ranks (any divisor of G) give the same "
                   "weights bit for bit and a resume on another number of ranks stays exact; recorded in the run's "
                   "config (docs/ENGINE.md, \"World size\")")
    p.add_argument("--probe-every", type=int, default=0, metavar="K",
                   help="replay the first checkpoint and then every K-th one in a side process (this command started "
                   "again, resuming it) and compare the next step bit for bit with this run's; a difference is one "
                   "warning line naming it (default 0: off; docs/VERIFY.md, \"The live probe\")")
    p.add_argument("--mtbf", help="--every auto: mean time between failures, e.g. 6h, 24h (default), 7d")
    p.add_argument("--max-redo", help="--every auto: at most this much work lost: N steps or a duration such as 30m")
    p.add_argument("--deadline", help="stop, save, upload and export (RUN/exports/) before this time: "
                   "2026-12-24T18:00Z or a duration such as 72h (docs/CADENCE.md)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--fresh", action="store_true", help="refuse a non-empty run folder instead of resuming")
    p.add_argument("--resume", type=Path, help="start from this step_NNNNNN.bin (another folder's generation, or a foreign .bin)")
    p.add_argument("--omit-rng-restore", action="store_true", help="verification negative case: do not restore random streams")
    p.add_argument("--no-audit", action="store_true", help="no sample audits")
    p.add_argument("--sync", action="store_true", help="synchronous saves (default: asynchronous)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: the run's recorded count, else torch's); "
                   "on the CPU recorded in config.json and compared on resume (docs/ENGINE.md, \"Precision and threads\")")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default=None,
                   help="the step's precision (default: the run's recorded one, else auto: bf16 on a CUDA GPU that has "
                   "it, else fp16 with a GradScaler; fp32 on the CPU); recorded in config.json and compared on resume "
                   "(docs/ENGINE.md, \"Precision and threads\")")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--allow-version-change", action="store_true")
    p.add_argument("--allow-code-change", action="store_true")
    p.add_argument("--allow-data-change", action="store_true")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume under another experiment config than the run's (--set, --config); the change is "
                   "recorded in the history and the lineage (docs/FORMAT.md)")
    p.add_argument("--shard", choices=["ddp", "fsdp"], default="ddp",
                   help="under torchrun: ddp (replicated; rank 0 writes .bin generations, default) or fsdp "
                   "(FSDP2 fully_shard; every rank writes step_NNNNNN.dcp generations)")
    p.add_argument("--require-signature", action="store_true",
                   help="sign every generation and resume only from validly signed ones (key: RIPRESA_HMAC_KEY[_FILE])")
    p.add_argument("--mirror", metavar="URL",
                   help="copy every generation to s3://bucket/prefix (AWS_* environment) or a path, in the background; "
                   "a blank --run folder resumes from it, config included (docs/MIRROR.md)")
    p.add_argument("--final-upload-timeout", metavar="SECONDS",
                   help="--mirror: how long a normal end waits for a store that cannot be reached to upload the final "
                   "generation (seconds or 15m; default 900, never past --deadline; 0: no wait). Still pending after "
                   "it: exit 3, upload it with `ripresa mirror push RUN`. SIGTERM keeps its short bound "
                   "(docs/MIRROR.md, \"The close\")")


def _every(text: str) -> int | str:
    """``--every``: ``auto`` or an int (checked in :func:`_cmd_train`)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {text!r}") from None


def _cmd_train(args: argparse.Namespace) -> int:
    from .engine.gpt.train import TrainArgs, run
    from .session.cadence import parse_duration, parse_max_redo
    from .session.checkpointer import local_run_dir
    from .session.deadline import deadline_time

    if args.run is not None:
        args.run = local_run_dir(args.run, "--run")  # s3://... is refused with the --mirror hint, never a folder 's3:'
    if args.steps is not None and args.steps < 0:
        raise BadInput("--steps must be >= 0", found=args.steps)
    if args.every is not None and args.every != "auto" and args.every < 0:
        raise BadInput("--every must be >= 0", expected="--every >= 0 (0: checkpoint on signals only)", found=args.every)
    if args.invariant < 0:
        raise BadInput("--invariant must be >= 1", expected="--invariant G, G micro-batches per step (a multiple of "
                       "every world size the run may use)", found=args.invariant, hint="docs/ENGINE.md, \"World size\"")
    if args.memory_every < 0:
        raise BadInput("--memory-every must be >= 0", expected="--memory-every >= 0 (0: no memory tier)",
                       found=args.memory_every, hint="docs/TIERS.md")
    if args.probe_every < 0:
        raise BadInput("--probe-every must be >= 0", expected="--probe-every >= 0 (0: no probe)",
                       found=args.probe_every, hint="docs/VERIFY.md, \"The live probe\"")
    if args.every != "auto" and (args.mtbf is not None or args.max_redo is not None):
        raise BadInput("--mtbf and --max-redo need --every auto", hint="add --every auto (docs/CADENCE.md)")
    if args.mtbf is not None:
        parse_duration(args.mtbf, "--mtbf")
    parse_max_redo(args.max_redo)
    deadline = deadline_time(args.deadline) if args.deadline is not None else None
    from .session.closing import parse_final_upload_timeout

    final_upload = parse_final_upload_timeout(args.final_upload_timeout, "--final-upload-timeout")
    if final_upload is not None and args.mirror is None:
        raise BadInput("--final-upload-timeout needs --mirror", found=args.final_upload_timeout,
                       hint="it bounds the wait for the mirror's store at the end (docs/MIRROR.md)")
    if args.require_signature:
        from .io.auth import require_from_cli

        require_from_cli("ripresa train --require-signature")
    return run(TrainArgs(
        run=args.run, output=args.output, config=args.config, sets=tuple(args.sets), sources=tuple(args.sources),
        steps=args.steps, every=args.every, device=args.device, fresh=args.fresh, resume=args.resume,
        omit_rng_restore=args.omit_rng_restore, audit=not args.no_audit, asynchronous=not args.sync,
        quiet=args.quiet, threads=args.threads, precision=args.precision, allow_version_change=args.allow_version_change,
        allow_code_change=args.allow_code_change, allow_data_change=args.allow_data_change,
        allow_config_change=args.allow_config_change,
        shard=args.shard, mirror=args.mirror, mtbf=args.mtbf, max_redo=args.max_redo, deadline=deadline,
        final_upload_timeout=final_upload, memory_every=args.memory_every, invariant=args.invariant,
        probe_every=args.probe_every,
    ))


# ----------------------------------------------------------------------------- advise
def _add_advise(sub: argparse._SubParsersAction) -> None:
    p = _command(
        sub, "advise", _cmd_advise,
        help="the checkpoint cadence a run should use, from its history, and the memory one step needs",
        description="Read RUN/.loss.jsonl (step times, checkpoint stalls and write times) and print, for each MTBF, "
        "the interval --every auto would choose (round(√(2·stall·MTBF)/step), bounded: docs/CADENCE.md), the "
        "expected work lost per failure and the overhead. For an ANDREA run (RUN/config.json, or --config without "
        "RUN), also the memory one step needs (parameters, gradients, AdamW, activations, the staging copy of a "
        "background save) against the device's, the host's and /dev/shm's, with a verdict (docs/CADENCE.md, "
        "\"Memory for a step\"). Read-only. Exit 0, or 2 when the history cannot tell.",
    )
    p.add_argument("run", type=Path, nargs="?", help="run folder (without it: --config, memory only)")
    p.add_argument("--mtbf", default="1h,6h,24h,7d", help="comma-separated MTBF values (default 1h,6h,24h,7d)")
    p.add_argument("--max-redo", help="bound: at most N steps or a duration such as 30m of work lost")
    p.add_argument("--config", help="size this config (tiny | andrea-12m | andrea-120m | FILE.toml) instead of the run's")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override for the memory sizing, e.g. train.batch_size=8")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default=None,
                   help="the precision to size (default: the run's recorded one, else auto)")
    p.add_argument("--device", default="auto", help="the device to size for: auto | cpu | cuda")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _cmd_advise(args: argparse.Namespace) -> int:
    from .engine.gpt.memory import memory_for, render_memory
    from .session.cadence import advise, render_advice

    if args.run is None and args.config is None:
        raise BadInput("advise needs a run folder or --config", expected="ripresa advise RUN | --config NAME",
                       hint="ripresa advise runs/NAME, or ripresa advise --config andrea-120m (memory only)")
    memory = memory_for(args.run, args.config, args.sets, args.precision, args.device)
    if memory is not None and not args.json:
        print(render_memory(memory))
    report = advise(args.run, args.mtbf.split(","), max_redo=args.max_redo) if args.run is not None else {}
    if args.json:
        import json

        print(json.dumps({**report, "memory": memory}, indent=2))
    elif report:
        print(render_advice(report))
    return 0


# ----------------------------------------------------------------------------- signal
def _add_signal(sub: argparse._SubParsersAction) -> None:
    p = _command(
        sub, "signal", _cmd_signal,
        help="ask the process training RUN to checkpoint (SIGUSR1) or stop (SIGTERM)",
        description="Send SIGUSR1 (checkpoint) or SIGTERM (checkpoint and stop) to the process holding RUN/LOCK: "
        "a `ripresa train`, or a program using ripresa.Checkpointer. LOCK's pid is checked against the kernel "
        "first (this host, this pid namespace, a live process that holds this LOCK); anything else is refused "
        "with exit 2 and nothing is signalled (docs/FAULTS.md, \"Signalling the trainer\").",
    )
    p.add_argument("run", type=Path, help="run folder")
    p.add_argument("action", choices=["checkpoint", "stop"])


def _cmd_signal(args: argparse.Namespace) -> int:
    import signal as _signal

    from .io.lock import signal_holder

    sig = _signal.SIGUSR1 if args.action == "checkpoint" else _signal.SIGTERM
    holder = signal_holder(args.run, sig)
    print(f"sent {sig.name} to pid {holder.pid} ({args.action})")
    return 0


# ----------------------------------------------------------------------------- pivot / fork
def _add_pivot(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "pivot", _cmd_pivot, help="change the data-mixture policy of a run without retraining (docs/ENGINE.md: Pivot and fork)")
    p.add_argument("run", type=Path, help="run folder (running or stopped)")
    p.add_argument("--caps", nargs="+", default=[], metavar="ARM=X", help="new maximum shares")
    p.add_argument("--floors", nargs="+", default=[], metavar="ARM=Y", help="new minimum shares")
    p.add_argument("--restart", action="store_true", help="restart the trainer detached with the flags its last launch "
                   "recorded (--mirror, --threads, --steps, --every, ...; log appended to RUN/train.log; docs/ENGINE.md)")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the trainer's checkpoint and stop")


def _cmd_pivot(args: argparse.Namespace) -> int:
    from .engine.pivot import pivot

    r = pivot(args.run, caps=args.caps, floors=args.floors, restart=args.restart, timeout=args.timeout)
    print(f"pivot at step {r['step']} (phase {r['phase']}): archived {r['archived'] or 'nothing'} into {r['archive']}")
    print(f"new policy: {r['policy']}")
    if r["launch"] is None:
        print("no launch record in the run's history: the original flags are unknown (ripresa train --run RUN only)")
    if r["mirrored"] is not None:
        print(f"mirror: uploaded {r['mirrored']['uploaded'] or 'nothing new'} and config.json to {r['mirrored']['url']}")
    if r["restarted"]:
        print(f"restarted the trainer (pid {r['restarted']}), log: {args.run / 'train.log'}")
    elif r["command"] is None:
        print(f"no resume command: {r['no_command']}")
    else:
        print(f"resume with: {r['command']}")
    return 0


def _add_fork(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "fork", _cmd_fork, help="copy generation N (hash-verified) into a new run, with overrides")
    p.add_argument("run", type=Path, help="parent run folder")
    p.add_argument("--step", type=int, required=True, help="the generation to fork from")
    p.add_argument("--into", type=Path, required=True, help="new run folder (must not exist or be empty)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.lr=1e-3")


def _cmd_fork(args: argparse.Namespace) -> int:
    from .engine.fork import fork

    r = fork(args.run, args.step, args.into, args.sets)
    what = f"bin sha256 {r['bin_sha256'][:16]}" if "bin_sha256" in r else f".dcp marker sha256 {r['dcp_marker_sha256'][:16]}"
    print(f"forked {args.run} at step {r['step']} into {r['into']} ({what}…, overrides {r['overrides']})")
    from .console import capped_lines

    for line in capped_lines(r.get("warnings", ()), lambda w: f"ripresa fork: warning: {w}", what="warnings"):
        print(line, file=sys.stderr)
    print(f"continue with: {r['command']}")
    return 0


# ----------------------------------------------------------------------------- plot / compare
def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "plot", _cmd_plot, help="PNG of a run: loss and EMA, checkpoints, events, arm shares")
    p.add_argument("run", type=Path, help="run folder")
    p.add_argument("--png", type=Path, help="output file (default RUN/plot.png)")


def _cmd_plot(args: argparse.Namespace) -> int:
    from .engine.plots import plot_run

    print(f"wrote {plot_run(args.run, args.png)}")
    return 0


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "compare", _cmd_compare, help="which of several runs (e.g. forks) converges lower, from the fork point")
    p.add_argument("runs", type=Path, nargs="+", help="two or more run folders")
    p.add_argument("--png", type=Path, help="PNG of the curves")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _cmd_compare(args: argparse.Namespace) -> int:
    from .engine.plots import compare_runs, render_comparison

    result = compare_runs(args.runs, args.png)
    if args.json:
        import json

        print(json.dumps(result, indent=2))
    else:
        from .text import safe_console

        render_comparison(result, safe_console())
        if args.png:
            print(f"wrote {args.png}")
    return 0


# ----------------------------------------------------------------------------- generate
def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "generate", _cmd_generate, help="complete a file of prompts into a crash-safe JSONL ledger (restartable, exactly once)",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)


def _cmd_generate(args: argparse.Namespace) -> int:
    from .engine.ledger import main as ledger_main

    return ledger_main(args.rest)


# ----------------------------------------------------------------------------- export
def _add_export(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "export", _cmd_export, help="a verified, self-describing bundle of a run (or --inference: weights only)")
    p.add_argument("run", nargs="?", help="run folder, or a store URL (s3://bucket/prefix, file:///path): its "
                   "generation pulled verified into a temporary folder first (docs/MIRROR.md, \"Tools on a "
                   "generation that lives only in the store\")")
    p.add_argument("--to", type=Path, help="destination folder (new or empty)")
    p.add_argument("--step", type=int, help="generation to export (default: newest valid; of a store: the newest "
                   "that verifies)")
    p.add_argument("--inference", action="store_true", help="weights only, as safetensors (not a resume checkpoint)")
    p.add_argument("--verify", type=Path, metavar="DEST", help="re-hash and reload an existing bundle instead")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _cmd_export(args: argparse.Namespace) -> int:
    from .engine.gpt.factory import GPT_FACTORY
    from .tools.export import export_run, render_export, verify_export

    if args.verify is not None:
        report = verify_export(args.verify, model_factory=GPT_FACTORY, show_progress=not args.json)
    else:
        if args.run is None or args.to is None:
            raise BadInput("ripresa export needs RUN and --to DEST", expected="ripresa export RUN|URL --to DEST [--step N] [--inference]")
        from .tools import from_store

        if from_store.is_store_url(args.run):  # a generation that lives only in the store (docs/MIRROR.md)
            with from_store.pulled(args.run, args.step) as got:
                print(got.line("exporting"), file=sys.stderr if args.json else sys.stdout)
                report = export_run(got.run, args.to, model_factory=GPT_FACTORY, step=got.step, inference=args.inference,
                                    show_progress=not args.json, source_run=got.url)
                report = {**got.relabel(report), "store": {"url": got.url, "step": got.step, "bytes": got.bytes,
                                                           "objects": got.objects}}
        else:
            report = export_run(from_store.local_path(args.run, "RUN"), args.to, model_factory=GPT_FACTORY, step=args.step,
                                inference=args.inference, show_progress=not args.json)
    if args.json:
        import json

        print(json.dumps(report, indent=2, default=str))
    else:
        render_export(report)
    return 0


# ----------------------------------------------------------------------------- convert
def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = _command(
        sub, "convert", _cmd_convert,
        help="convert a checkpoint between .dcp, .bin (generation or plain), checkpoint.pt and safetensors, verified",
        description="Convert SRC into DEST (format by name: step_NNNNNN.dcp, step_NNNNNN.shards, step_NNNNNN.bin generation, NAME.bin plain, "
        "NAME.pt, NAME.safetensors weights only), then read DEST back and compare it bitwise with SRC. "
        "DEST must not exist. Missing state is never invented: a plain .bin or safetensors converts only to formats "
        "that hold no more. Exit 0 verified, 1 the re-read differs, 2 bad input.",
    )
    p.add_argument("src", help="the checkpoint to convert, or a store URL (s3://bucket/prefix, file:///path): its "
                   "generation pulled verified into a temporary folder first (docs/MIRROR.md, \"Tools on a "
                   "generation that lives only in the store\")")
    p.add_argument("dest", type=Path, help="the new checkpoint (its name gives the format)")
    p.add_argument("--step", type=int, help="with a store URL: this generation (default: the newest that verifies)")
    p.add_argument("--config", help="the model, for a source without a config: tiny | andrea-12m | andrea-120m | FILE.toml")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _cmd_convert(args: argparse.Namespace) -> int:
    from .engine.gpt.factory import GPT_FACTORY
    from .tools import from_store
    from .tools.convert import convert

    if from_store.is_store_url(args.src):  # a generation that lives only in the store (docs/MIRROR.md)
        with from_store.pulled(args.src, args.step) as got:
            print(got.line("converting"), file=sys.stderr if args.json else sys.stdout)
            r = got.relabel(convert(got.path, args.dest, model_factory=GPT_FACTORY, config=args.config))
    elif args.step is not None:
        raise BadInput("--step needs a store URL", found=f"--step {args.step} with {args.src}",
                       hint="name the generation itself: ripresa convert RUN/step_NNNNNN.* DEST")
    else:
        r = convert(from_store.local_path(args.src, "SRC"), args.dest, model_factory=GPT_FACTORY, config=args.config)
    if args.json:
        import json

        print(json.dumps(r, indent=2))
    else:
        print(f"converted {r['source_kind']} {r['source']} → {r['dest_kind']} {r['dest']} (step {r['step']}, "
              f"{r['n_params']:,} parameters); read back and compared bitwise ({r['compared']} state): identical")
    return 0


# ----------------------------------------------------------------------------- fingerprint
def _add_fingerprint(sub: argparse._SubParsersAction) -> None:
    p = _command(
        sub, "fingerprint", _cmd_fingerprint,
        help="one hash of a generation's state whatever its layout (.bin, .safetensors, .shards, .dcp, HF folder)",
        description="A Merkle hash over (name, dtype, shape, bytes in logical order) of every value of a generation, "
        "with one sub-hash per part (model, optimizer, steps, hyper, rng, data, ...): the same for the same state in "
        "an ANDREA .bin, a general .safetensors generation, a .shards folder of any K, a .dcp folder of any world "
        "size, a plain DCP folder or a Hugging Face checkpoint-N folder (docs/INSPECT.md, \"The state fingerprint\"). "
        "With two paths, says whether the parts both hold are equal and names the first values that differ. "
        "Reads every tensor; checks no commit marker (inspect does). Exit 0 (two paths: the same state), "
        "1 a check failed or the states differ, 2 bad input.",
        usage="ripresa fingerprint PATH [OTHER] [--json] [--leaves] [--threads N]",
    )
    p.add_argument("path", type=Path, help="a generation: step_NNNNNN.bin/.safetensors/.shards/.dcp, checkpoint.pt, "
                   "a DCP folder or a Hugging Face checkpoint-N folder")
    p.add_argument("other", type=Path, nargs="?", help="a second generation to compare with")
    p.add_argument("--json", action="store_true", help="print one JSON document (keys: docs/INSPECT.md)")
    p.add_argument("--leaves", action="store_true", help="with --json: the digest of every value too")
    p.add_argument("--threads", type=int, help="threads that hash (default: the CPUs this process may use)")


def _bin_model(path: Path) -> Any:
    """For an ANDREA ``.bin`` of a run folder whose ``config.json`` has a ``model`` section: its GPT on the meta
    device (names only, nothing allocated), so the ``.bin``'s offsets get their parameter names. Else None."""
    import json
    import os

    from .formats.andrea_bin import read_header
    from .io.fsio import read_small

    cfg_path = path.parent / "config.json"
    if path.suffix != ".bin" or not os.path.lexists(cfg_path):
        return None
    try:
        cfg = json.loads(read_small(cfg_path, "config.json", 16 << 20))
        import torch

        from .engine.gpt.factory import GPT_FACTORY

        with torch.device("meta"):
            return GPT_FACTORY.build_model(cfg["model"], read_header(path).n_params, path)
    except (RipresaError, ValueError, KeyError, TypeError):
        return None  # not an ANDREA run's config: the .bin is named from its companion, or positionally


def _cmd_fingerprint(args: argparse.Namespace) -> int:
    from .tools.fingerprint import fingerprint, render, report

    if args.threads is not None and not 1 <= args.threads <= 1024:
        raise BadInput("--threads out of range", expected="1..1024", found=args.threads)
    paths = [p for p in (args.path, args.other) if p is not None]
    prints = [fingerprint(p, model=_bin_model(p), threads=args.threads, show_progress=not args.json) for p in paths]
    doc = report(paths, prints, leaves=args.leaves)
    if args.json:
        import json

        print(json.dumps(doc, indent=2))
    else:
        render(doc)
    return int(doc["exit_code"])


# ----------------------------------------------------------------------------- mirror
def _add_mirror(sub: argparse._SubParsersAction) -> None:
    p = _command(
        sub, "mirror", _cmd_mirror,
        help="a run's second store: what is where, push what is missing, pull a generation (docs/MIRROR.md)",
        description="status: the run's committed generations locally and in the mirror, half uploads, what is pending. "
        "push: upload what the mirror lacks (not while a trainer holds RUN: it uploads itself). pull: download the "
        "newest (or --step) remote generation whose marker verifies into RUN, with config.json. The URL defaults to "
        "RUN/mirror.json's. Exit 0 done, 1 nothing verifies, 2 bad URL, missing credentials or boto3, store unreachable.",
    )
    p.add_argument("action", choices=["status", "push", "pull"])
    p.add_argument("run", type=Path, help="run folder")
    p.add_argument("--mirror", metavar="URL",
                   help="s3://bucket/prefix, file:///path or a path (push without it follows RUN/mirror.json only when "
                   "the run's key authenticates it, or when the target is already a mirror: docs/MIRROR.md, Trust)")
    p.add_argument("--step", type=int, help="pull: this generation (default: the newest that verifies)")
    p.add_argument("--keep", help="push (and status, to plan the same push): the mirror's retention, e.g. last=6 "
                   "(default: twice the local last=3)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _steps(steps: list[int]) -> str:
    """A list of steps as ``[1, 2, ... N more]`` (capped: docs/INSPECT.md, "Long lists"; --json has them all)."""
    from .console import joined

    return f"[{joined(steps, what='steps')}]" if steps else ""


def _cmd_mirror(args: argparse.Namespace) -> int:
    from .store import mirror
    from .store.retention import parse_retention

    keep = parse_retention(args.keep, source="--keep") if args.keep and args.action != "pull" else None
    if args.action == "status":
        r = mirror.cli_status(args.run, args.mirror, keep)
    elif args.action == "push":
        r = mirror.cli_push(args.run, args.mirror, keep)
    else:
        r = mirror.cli_pull(args.run, args.mirror, args.step)
    if args.json:
        import json

        print(json.dumps(r, indent=2))
    elif args.action == "status":
        print(f"run {r['run']}  mirror {r['url']}")
        print(f"  local:  {_steps(r['local']) or 'none'}")
        print(f"  remote: {_steps(r['remote']) or 'none'}" + ("  (+ config.json)" if r["config_remote"] else ""))
        print(f"  {'in flight (the trainer uploads them)' if r['trainer_running'] else 'missing (push uploads them)'}: "
              f"{_steps(r['pending']) or 'none'}" + (f"  ({r['pending_bytes']:,} bytes)" if r["pending"] else ""))
        if r["partial"]:
            print(f"  partly in the store (push uploads them whole): {_steps(r['partial'])}")
        if r["not_needed"]:
            print(f"  not uploaded (the mirror's retention keeps newer ones): {_steps(r['not_needed'])}")
        import textwrap

        from .console import capped, more_line

        damaged, more = capped(r["damaged"])
        for d in damaged:  # the reason on its own lines: 80 columns
            print(f"  not uploaded, damaged locally: step {d['step']} ({d['file']})")
            print(textwrap.fill(d["reason"], width=78, initial_indent="    ", subsequent_indent="    "))
        if more:
            print("  " + more_line(more, "damaged generations"))
        if r["half_uploaded"]:
            print(f"  half uploaded (no marker; never used, cleaned by the next writer): {_steps(r['half_uploaded'])}")
    elif args.action == "push":
        print(f"pushed {_steps(r['uploaded']) or 'nothing (the mirror had everything)'} to {r['url']}")
    else:
        print(f"pulled {r['file']} (step {r['step']}, verified) into {r['run']}" + (" with config.json" if r["config"] else ""))
    return 0


# ----------------------------------------------------------------------------- rehearse
def _add_rehearse(sub: argparse._SubParsersAction) -> None:
    p = _command(
        sub, "rehearse", _cmd_rehearse,
        help="rehearse a rental's save, stop, pull from the mirror and resume, on scratch copies, timed",
        description="On scratch copies of the run's newest generation: train K steps mirroring to a scratch prefix "
        "beside the run's mirror, SIGTERM (save, upload, exit), pull into a blank folder, resume K steps, and compare "
        "bit for bit with the same steps uninterrupted; then export. Times and bytes of each step, set against the "
        "deadline. The run folder and the mirror's generations are never written; the scratch is removed. "
        "Exit 0 identical, 1 they differ, 2 not done (no mirror, store unreachable, a trainer failed). "
        "docs/OPERATIONS.md, \"Rehearse the rental's cycle at the start\".",
    )
    p.add_argument("run", type=Path, help="the run folder (ripresa train --run RUN --mirror URL), live or not")
    p.add_argument("--mirror", metavar="URL", help="the run's mirror (default: RUN/mirror.json's, docs/MIRROR.md)")
    p.add_argument("--deadline", help="the rental's end: 2026-12-24T18:00Z or a duration such as 72h "
                   "(default: the run's last launch's --deadline; docs/CADENCE.md)")
    p.add_argument("--steps", type=int, default=10, metavar="K", help="steps before the stop and after the resume (default 10)")
    p.add_argument("--output", type=Path, help="new folder for rehearsal.json and rehearsal.log (default RUN.rehearsal-TIMESTAMP beside RUN)")
    p.add_argument("--scratch", metavar="URL", help="an empty scratch prefix (default: beside the mirror's, same store)")
    p.add_argument("--config", help="a run with no generation anywhere: the config of its first K steps (default RUN/config.json)")
    p.add_argument("--device", help="auto | cpu | cuda (default: the run's last launch's)")
    p.add_argument("--threads", type=int, help="torch CPU threads of the trainers (default: the run's last launch's)")
    p.add_argument("--omit-rng-restore", action="store_true",
                   help="negative control: the resume skips the random streams; the comparison must fail (exit 1)")
    p.add_argument("--json", action="store_true", help="print rehearsal.json instead of the table")


def _cmd_rehearse(args: argparse.Namespace) -> int:
    from .engine.rehearse import rehearse, render_rehearsal

    r = rehearse(args.run, output=args.output, mirror=args.mirror, scratch=args.scratch, steps=args.steps,
                 deadline=args.deadline, config=args.config, device=args.device, threads=args.threads,
                 omit_rng_restore=args.omit_rng_restore)
    if args.json:
        import json

        print(json.dumps(r, indent=2))
    else:
        from .text import safe_console

        render_rehearsal(r, safe_console())
    return r["exit_code"]


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ripresa",
        description="Crash-safe, verifiable checkpoints and exact resume for PyTorch training runs.",
        epilog="exit codes: 0 success, 1 a check failed, 2 bad input or work not completed, "
        "3 train --mirror: the final generation is not in the mirror (upload pending)",
    )
    parser.add_argument("--version", action="version", version=f"ripresa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_verify(sub)
    _add_demo(sub)
    _add_train(sub)
    _add_signal(sub)
    _add_advise(sub)
    _add_pivot(sub)
    _add_fork(sub)
    _add_plot(sub)
    _add_compare(sub)
    _add_generate(sub)
    _add_export(sub)
    _add_inspect(sub)
    _add_convert(sub)
    _add_fingerprint(sub)
    _add_mirror(sub)
    _add_rehearse(sub)
    return parser


def _unexpected(command: str, exc: BaseException) -> int:
    """The last-resort report of an exception no check anticipated: one paragraph, exit 2, no traceback.

    ``RIPRESA_DEBUG=1`` re-raises instead (the traceback is for developers).
    """
    import os

    if os.environ.get("RIPRESA_DEBUG") == "1":
        raise exc
    from .io.redact import redact

    text = escape_terminal(redact(str(exc))[:300], newlines=False) if not isinstance(exc, RecursionError) else "nesting too deep"
    print(f"ripresa {command}: error: the command could not complete: {type(exc).__name__}: {text}\n"
          f"  hint:     this is a bug in ripresa or an input it does not recognise; please report it with the "
          f"command line (RIPRESA_DEBUG=1 shows the traceback). No checkpoint was changed by this report.",
          file=sys.stderr)
    return 2


def _refuse_unknown_command(own: list[str]) -> None:
    """A mistyped command is bad input (exit 2) naming the commands and the nearest ones (a typo: ``inpsect``)."""
    if not own or own[0].startswith("-") or own[0] in _COMMANDS or own[0] == "generate":
        return
    import difflib

    near = difflib.get_close_matches(own[0], sorted(_COMMANDS), n=3, cutoff=0.6)
    raise BadInput("unknown command", expected=", ".join(sorted(_COMMANDS)), found=own[0],
                   hint=("did you mean " + " or ".join(repr(n) for n in near) + "?") if near else "ripresa --help")


def _refuse_unknown_options(command: str, extra: list[str], parser: argparse.ArgumentParser | None = None) -> None:
    """An option the command does not have is bad input (exit 2) naming the nearest ones (a typo: ``--stpes``),
    checked before argparse's own errors (a typo beside a missing required option names the typo)."""
    import difflib

    parser = parser or _PARSERS.get(command)
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS] if parser else []
    known = sorted({o for a in shown for o in a.option_strings if o.startswith("--")})
    options = [x.split("=", 1)[0] for x in extra if x.startswith("--") and x != "--"]
    typed = [o for o in options if not any(k.startswith(o) for k in known)]  # argparse takes a unique prefix
    if not typed:
        typed = [x for x in extra if not x.startswith("--")][:1] if extra and not options else []
        if not typed:
            return
        raise BadInput(f"unexpected argument for `ripresa {command}`", found=typed[0][:200],
                       hint=f"ripresa {command} --help")
    near = difflib.get_close_matches(typed[0], known, n=3, cutoff=0.6)
    raise BadInput(f"unknown option{'s' if len(typed) > 1 else ''} for `ripresa {command}`", found=" ".join(typed)[:200],
                   expected=f"one of its {len(known)} options (ripresa {command} --help)",
                   hint=("did you mean " + " or ".join(near) + "?") if near else f"ripresa {command} --help")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ripresa`` and ``python -m ripresa``; returns the exit code.

    A ``torchrun`` rank whose process group ``ripresa train`` created leaves
    through ``session.distributed.leave`` instead (docs/ARCHITECTURE.md,
    "Distributed runs": the gloo exit abort).
    """
    from .session.signals import hold

    hold()  # first: a SIGUSR1 while ripresa starts (imports, resume) is deferred to the run's first step, never fatal
    undo = None
    if argv is None:  # the program (not a caller's in-process call): its warnings reach a terminal as one line each
        from .console import install

        undo = install(sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "ripresa")
    try:
        code = _main(argv)
    finally:
        if undo is not None:
            undo()
    if "torch.distributed" in sys.modules:  # only a command that used torch.distributed can have created a group
        from .session.distributed import leave

        return leave(code)
    return code


def _main(argv: Sequence[str] | None = None) -> int:
    """:func:`main`, without the exit of a distributed rank.

    Every failure maps to exit 1 (a check failed: :class:`~ripresa.errors.CheckFailed`)
    or 2 (bad input or work not completed); an unexpected exception gets a
    one-paragraph report and exit 2, never a traceback (docs/FAULTS.md).
    """
    raw = list(sys.argv[1:] if argv is None else argv)
    own, trainer = _split_command(raw)
    command = own[0] if own else "ripresa"
    try:
        if own[:1] == ["generate"]:  # its options are parsed by ripresa.engine.ledger (one parser, one place)
            from .engine.ledger import build_parser as ledger_parser
            from .engine.ledger import main as ledger_main

            _refuse_unknown_options("generate", [x for x in own[1:] if x.startswith("--")], ledger_parser())
            return ledger_main(own[1:])
        parser = build_parser()
        _refuse_unknown_command(own)
        if own[:1] and own[0] in _PARSERS:
            _refuse_unknown_options(own[0], [x for x in own[1:] if x.startswith("--")])
        args, extra = parser.parse_known_args(own)
        if extra:  # a mistyped option: the command's own options and the nearest, not the top-level usage
            _refuse_unknown_options(args.command, extra)
        args.trainer = trainer
        command = args.command
        return _COMMANDS[args.command](args)
    except RipresaError as exc:
        from .io.redact import redact

        print(f"ripresa {command}: error: {redact(str(exc))}", file=sys.stderr)  # no credential reaches the terminal
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"ripresa {command}: interrupted", file=sys.stderr)
        return 2
    except SystemExit:
        raise  # argparse's --help / usage errors (exit 0 / 2)
    except BrokenPipeError:  # e.g. `ripresa inspect ... | head`
        return 2
    except (Exception, RecursionError, MemoryError) as exc:  # noqa: BLE001 - the last resort, see _unexpected
        from .console import translated

        meant = translated(exc)  # a collective that failed because a node is gone: NodeLost (docs/DISTRIBUTED.md)
        if isinstance(meant, RipresaError):
            print(f"ripresa {command}: error: {meant}", file=sys.stderr)
            return meant.exit_code
        return _unexpected(command, exc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
