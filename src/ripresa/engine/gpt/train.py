"""``ripresa train``: the ANDREA byte-level GPT, trained through the public Checkpointer.

Reads top to bottom: resolve the config → build data sources, bandit mixture, model, AdamW,
schedule → describe the state → open the run folder (resume) → train, with a checkpoint every
``--every`` steps (asynchronous), a sample audit at the same cadence, SIGTERM/SIGUSR1 handled at
step boundaries, and one history line per step.

``--run`` (a long run) and ``--output`` (the ``ripresa verify`` contract), and ``torchrun`` (DDP, or
FSDP2 with ``--shard fsdp``): docs/ENGINE.md, "``ripresa train``"; docs/OPERATIONS.md, "More than
one GPU"; the sharded generations: :mod:`ripresa.session.distributed`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Imported here, before any seeding or restore, on purpose: importing rich draws
# from Python's global `random` (rich.style seeds an id counter with
# getrandbits). Imported lazily after a restore, that draw shifted the restored
# stream — the resume verifier caught it (next_draws.python at the end).
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ...core.numbers import checked_number
from ...core.rng import RandomStreams
from ...core.state import TrainingState, config_change_error, config_changes
from ...errors import BadInput, OutputExists, UploadPending
from ...formats.andrea_bin import BYTES_PER_PARAM, HEADER_SIZE, parse_bin_name
from ...formats.bin_state import bin_suits
from ...io.fsio import open_run_file, read_json_small, write_atomic
from ...session.checkpointer import Checkpointer
from ...session.distributed import (
    DistContext,
    init_from_env,
    rank_generator,
    rank_seed,
    torchrun_env,
)
from ...store.history import HISTORY_NAME
from ...verify.trajectory import Trajectory
from ..mixture import BanditMixture, MixturePolicy, ZombieArmWarning
from .config import load_config_file, resolve_config
from .model import GPT, from_config_dict
from .sources import TextSource, source_from_spec

SAMPLES_NAME = ".samples.json"
#: Config keys that are operational settings, not the experiment: a resume may change them.
OPERATIONAL_CONFIG = ("train.every",)
STATE_NAME = ".state.json"


@dataclass
class TrainArgs:
    """What ``ripresa train`` was asked (see ``ripresa train --help``)."""

    run: Path | None = None
    output: Path | None = None
    config: str | None = None
    sets: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    steps: int | None = None
    every: int | str | None = None  # steps, or "auto" (docs/CADENCE.md)
    device: str = "auto"
    fresh: bool = False
    resume: Path | None = None
    omit_rng_restore: bool = False
    audit: bool = True
    asynchronous: bool = True
    quiet: bool = False
    threads: int | None = None
    precision: str | None = None  # fp32 | bf16 | fp16 | auto; None: the run's recorded one, else auto (docs/ENGINE.md)
    allow_version_change: bool = False
    allow_code_change: bool = False
    allow_data_change: bool = False
    allow_config_change: bool = False
    shard: str = "ddp"
    mirror: str | None = None
    mtbf: str | None = None  # --every auto: mean time between failures (default 24h)
    max_redo: str | None = None  # --every auto: at most N steps or a duration of work lost
    deadline: float | None = None  # POSIX time: stop, save, upload and export before it
    final_upload_timeout: float | None = None  # --mirror: a normal end's wait for the store (None: 900 s)
    memory_every: int = 0  # the memory tier's cadence in steps (0: off; docs/TIERS.md)
    invariant: int = 0  # world-size-invariant steps of G micro-batches (0: the run's config; docs/ENGINE.md)
    probe_every: int = 0  # replay every K-th checkpoint in a side process and compare (0: off; docs/VERIFY.md)


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda but CUDA is not available", expected="a CUDA device", found="CPU only",
                       hint="use --device auto or cpu")
    if choice not in ("cpu", "cuda"):
        raise BadInput("unknown --device", expected="auto, cpu or cuda", found=choice)
    return torch.device(choice)


def lr_at(step: int, t: dict[str, Any]) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine to ``min_lr`` at ``max_steps``."""
    lr, min_lr, warm, total = t["lr"], t["min_lr"], t["warmup_steps"], max(1, t["max_steps"])
    if step < warm:
        return lr * (step + 1) / warm
    frac = min(1.0, (step - warm) / max(1, total - warm))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (lr - min_lr)


def lr_floor_warning(t: dict[str, Any], step: int = 0) -> str | None:
    """The warning for a ``train.lr`` below the schedule's floor ``train.min_lr`` (None when it is not).

    :func:`lr_at` decays from ``lr`` to ``min_lr``: with ``lr < min_lr`` that
    "decay" *raises* the learning rate, which nobody asking for a lower one
    means (docs/ENGINE.md, "The learning-rate schedule"). Said once when a
    process starts (``train``) or a fork writes its config (``fork``).
    """
    lr, floor = float(t["lr"]), float(t["min_lr"])
    if not lr < floor:
        return None
    now, end = lr_at(step, t), lr_at(max(step, int(t["max_steps"])), t)
    return (f"train.lr={lr:g} is below the schedule's floor train.min_lr={floor:g}: the cosine schedule goes from "
            f"lr to min_lr, so the learning rate rises ({now:.3g} at step {step}, {end:.3g} at step "
            f"{max(step, int(t['max_steps']))}) instead of decaying; to decay from {lr:g}, also lower the floor, "
            f"e.g. --set train.min_lr={lr / 10:g}")


class MixtureSlot:
    """The bandit as a ``Stateful`` of the checkpoint, with the ANDREA run's two rules.

    * A saved state of an earlier *phase* (a pivot happened) is not loaded:
      the bandit starts fresh under the new policy.
    * Arms of the saved state whose source no longer exists are zombie arms:
      dropped with a warning (and a history event written by the trainer).
    """

    def __init__(self, mixture: BanditMixture) -> None:
        self.mixture = mixture
        self.skipped_for_pivot: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return self.mixture.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("phase", 0)) != self.mixture.phase:
            self.skipped_for_pivot = int(state.get("phase", 0))
            return
        self.mixture.load_state_dict(state)


class SamplerSlot:
    """The crop sampler as a ``Stateful``; non-strict only when arms were dropped on purpose."""

    def __init__(self, sampler: Any, strict: bool) -> None:
        self.sampler, self.strict = sampler, strict

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state, strict=self.strict)


def load_arms(specs: list[str], history_notes: list[dict[str, Any]], *, new_run: bool = False) -> dict[str, TextSource]:
    """Build every configured source; a user source whose path vanished is a zombie arm.

    On a new run (``new_run``: nothing to resume, no run config) a source path
    that does not exist is a typo, not a vanished source: :class:`BadInput`
    (exit 2) naming it (docs/ENGINE.md, "Data sources on a new run").
    """
    arms: dict[str, TextSource] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if sep and not os.path.exists(path) and new_run:
            raise BadInput(f"data source '{name}' does not exist", file=path,
                           expected="a text file or a folder of text files (--source NAME=PATH)",
                           found="a dangling link" if os.path.islink(path) else "nothing at this path",
                           hint="check the path; a new run does not start without the data it names "
                                "(a source that vanishes from a resumed run is dropped as a zombie arm: docs/ENGINE.md)")
        if sep and not os.path.exists(path):
            msg = f"data source '{name}' ({path}) no longer exists: its arm is dropped (zombie arm)"
            warnings.warn(msg, ZombieArmWarning, stacklevel=2)
            history_notes.append({"event": "zombie_arm", "arm": name, "path": path, "reason": "source missing"})
            continue
        src = source_from_spec(spec)
        arms[src.name] = src
    if not arms:
        raise BadInput("no data source is available", expected="at least one", found=specs)
    return arms


#: Largest ``.samples.json`` read back at a resume (bytes).
SAMPLES_MAX = 64 << 20
#: Files of a run folder that ``train --run`` reads or appends to.
RUN_FILES = ("config.json", HISTORY_NAME, SAMPLES_NAME, STATE_NAME, "lineage.json")


def check_run_files(run_dir: Path) -> None:
    """Refuse a run folder whose own files are links or special files, before anything reads them.

    Each of :data:`RUN_FILES` that exists is opened with
    :func:`~ripresa.io.fsio.open_run_file`: a symlink (never followed out of the
    folder), a FIFO (never waited on), a socket, device or folder in its place
    is a :class:`~ripresa.errors.BadInput` (exit 2) (``docs/FAULTS.md``).
    """
    for name in RUN_FILES:
        path = run_dir / name
        if os.path.lexists(path):
            os.close(open_run_file(path, f"the run's {name}"))


def check_model_fits_run(run_dir: Path, param_count: int) -> None:
    """Refuse a config whose model has another parameter count than every ``.bin`` of the run.

    Computed from the config (nothing allocated) and compared with the size of
    the run's generations, so a hostile ``config.json`` cannot make a resume
    build a model of gigabytes before the checkpoint's check refuses it.
    """
    sizes = {}
    try:
        entries = list(os.scandir(run_dir))
    except OSError:
        return
    for entry in entries:
        step = parse_bin_name(entry.name)
        if step is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        sizes[step] = st.st_size
    if not sizes:
        return
    want = HEADER_SIZE + BYTES_PER_PARAM * param_count
    if want not in sizes.values():
        newest = max(sizes)
        raise BadInput("the config's model does not match the run's checkpoints", file=run_dir / "config.json",
                       expected=f"a model whose {param_count} parameters fill a .bin of {want} bytes",
                       found=f"step {newest}: a .bin of {sizes[newest]} bytes",
                       hint="resume with the config the run was trained with (a --set of model.* needs a new run); "
                            "nothing was built")


def read_samples(run_dir: Path, phase: int) -> dict[str, Any]:
    """The run's ``.samples.json`` (bounded, no link, no FIFO); a fresh one if it is missing or malformed."""
    fresh: dict[str, Any] = {"phase": phase, "audits": []}
    path = run_dir / SAMPLES_NAME
    if not os.path.lexists(path):
        return fresh
    os.close(open_run_file(path, f"the run's {SAMPLES_NAME}"))  # a link or FIFO is refused, not replaced
    try:
        doc = read_json_small(path, f"the run's {SAMPLES_NAME}", SAMPLES_MAX)
    except BadInput:
        return {**fresh, "note": f"previous {SAMPLES_NAME} was unreadable"}
    audits = doc.get("audits") if isinstance(doc, dict) else None
    if not isinstance(audits, list) or not all(
            isinstance(a, dict) and isinstance(a.get("step"), int) and not isinstance(a.get("step"), bool)
            for a in audits):
        return {**fresh, "note": f"previous {SAMPLES_NAME} was malformed"}
    return doc


def write_samples(run_dir: Path, doc: dict[str, Any]) -> None:
    write_atomic(run_dir / SAMPLES_NAME, [json.dumps(doc, indent=1).encode() + b"\n"])


#: ``--precision`` values as recorded in ``config.json`` (``train.precision``); ``auto`` resolves to one of them.
PRECISIONS = ("fp32", "bf16", "fp16")
#: Config keys recorded by ``ripresa train`` itself (not by a preset): a run's ``config.json`` written before
#: they were recorded lacks them, and such a run is not refused for it (docs/ENGINE.md, "Precision and threads").
RECORDED_RUNTIME = ("precision", "threads")


def resolve_precision(asked: str | None, cfg: dict[str, Any], run_config: dict[str, Any] | None,
                      device: torch.device, source: Path | None) -> str:
    """The step's precision: ``--precision``, else the config's / the run's ``train.precision``, else ``auto``.

    ``auto``: bf16 on a CUDA device that supports it, fp16 (with a GradScaler) on one that does not, fp32 on
    the CPU (docs/ENGINE.md, "Precision and threads"). A recorded value that is not one of
    :data:`PRECISIONS` is refused (a hostile ``config.json``).
    """
    recorded = cfg["train"].get("precision")
    if recorded is None and run_config is not None and isinstance(run_config.get("train"), dict):
        recorded = run_config["train"].get("precision")
    if recorded is not None and recorded not in (*PRECISIONS, "auto"):
        raise BadInput("train.precision is not a precision", file=source, expected=list(PRECISIONS),
                       found=repr(recorded)[:80], hint="ripresa train --precision fp32|bf16|fp16|auto")
    choice = asked if asked is not None else recorded if recorded is not None else "auto"
    if choice == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "fp32"
    if choice not in PRECISIONS:
        raise BadInput("unknown --precision", expected=["auto", *PRECISIONS], found=choice)
    if choice == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise BadInput("--precision bf16 on a GPU without bfloat16", expected="a GPU that supports bf16",
                       found=torch.cuda.get_device_name(device), hint="use --precision fp16 (GradScaler) or fp32")
    return choice


def resolve_threads(asked: int | None, cfg: dict[str, Any], run_config: dict[str, Any] | None,
                    device: torch.device, source: Path | None) -> int | None:
    """Set torch's CPU thread count and return what ``config.json`` records as ``train.threads``.

    ``--threads``, else the run's recorded ``train.threads``, else torch's default. On the CPU the count decides
    the trajectory (a parallel reduction sums in another order with another number of threads), so it is
    recorded and compared like the experiment config; on CUDA the step does not run on these threads: ``None``
    is recorded (docs/ENGINE.md, "Precision and threads").
    """
    recorded = cfg["train"].get("threads")
    if recorded is None and run_config is not None and isinstance(run_config.get("train"), dict):
        recorded = run_config["train"].get("threads")
    if recorded is not None and (type(recorded) is not int or not 1 <= recorded <= 4096):
        raise BadInput("train.threads is not a thread count", file=source, expected="an integer 1..4096 or null",
                       found=repr(recorded)[:80], hint="ripresa train --threads N")
    if asked == 0:  # --threads 0: torch's default, as before (and as a recorded launch may replay it)
        asked = None
    if asked is not None and not 1 <= asked <= 4096:
        raise BadInput("--threads must be 1..4096 (0: torch's default)", found=asked)
    n = asked if asked is not None else recorded if device.type == "cpu" and recorded is not None else None
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads() if device.type == "cpu" else None


def runtime_reference(run_config: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The run's config as compared: a :data:`RECORDED_RUNTIME` key it lacks (written before it was recorded)
    takes this process's value, so an older run is not refused for lacking it."""
    train_cfg = run_config.get("train")
    if not isinstance(train_cfg, dict):
        return run_config
    missing = [k for k in RECORDED_RUNTIME if k not in train_cfg]
    if not missing:
        return run_config
    return {**run_config, "train": {**train_cfg, **{k: cfg["train"].get(k) for k in missing}}}


def run(args: TrainArgs) -> int:
    """Train; returns the exit code (0: done or stopped by a signal with a checkpoint). With ``--mirror``, a run
    whose final generation could not be uploaded raises :class:`~ripresa.errors.UploadPending` (exit 3) after the
    end (docs/MIRROR.md, "The close")."""
    if (args.run is None) == (args.output is None):
        raise BadInput("give exactly one of --run or --output", expected="--run DIR or --output DIR")
    if args.shard not in ("ddp", "fsdp"):
        raise BadInput("unknown --shard", expected="ddp or fsdp", found=args.shard)
    env = torchrun_env()
    if args.shard == "fsdp" and env is None:
        raise BadInput("--shard fsdp needs a process group", expected="a launch by torchrun",
                       hint="torchrun --standalone --nproc_per_node=N -m ripresa train --shard fsdp ...")
    device = pick_device(args.device)
    created_group = False
    if env is not None:
        import torch.distributed as tdist

        was = tdist.is_available() and tdist.is_initialized()
        if init_from_env(device.type, need_group=args.shard == "fsdp"):
            created_group = not was
            if device.type == "cuda":
                device = torch.device("cuda", env["local_rank"])
    ok = False
    pending: UploadPending | None = None
    try:
        try:
            code = _run(args, device)
        except UploadPending as exc:  # the run is complete, its upload is not: the group still ends normally
            code, pending = exc.exit_code, exc
        ok = True
    finally:
        if created_group:
            import gc

            import torch.distributed as tdist

            if ok:
                tdist.barrier()  # no rank tears the group down while another still uses it
            gc.collect()  # the DDP wrapper (a reference cycle) goes before its process group
            tdist.destroy_process_group()
    if pending is not None:
        raise pending  # exit 3 (docs/FAULTS.md, "Exit codes"): the final generation is only on this machine
    return code


def _run(args: TrainArgs, device: torch.device) -> int:
    import torch.distributed as tdist

    group = tdist.is_available() and tdist.is_initialized()
    rank = tdist.get_rank() if group else 0
    world = tdist.get_world_size() if group else 1
    if args.output is not None and os.path.lexists(args.output):
        raise OutputExists("output folder already exists", file=args.output, expected="a new folder",
                           found="an existing path", hint="--output never reuses a folder; use --run to resume one")
    run_dir = args.run if args.run is not None else args.output
    assert run_dir is not None
    if args.fresh and run_dir.exists() and any(run_dir.iterdir()):
        raise BadInput("--fresh refuses a run folder that is not empty", file=run_dir,
                       hint="choose a new --run folder, or drop --fresh to resume this one")
    if args.mirror is not None and args.run is not None and rank == 0 and not args.fresh:
        from ...store.mirror import prefetch

        prefetch(run_dir, args.mirror)  # a blank machine: the newest verified remote generation and config.json
    if args.run is not None and os.path.lexists(run_dir):
        check_run_files(run_dir)
    if group:
        tdist.barrier()  # every rank has looked at the folder before rank 0 creates anything in it
    cfg = resolve_config(args.config, args.sets, run_dir if args.output is None else None, args.sources)
    if args.every is not None and args.every != "auto":
        cfg["train"]["every"] = args.every
    if args.invariant:  # part of the experiment config: a resume keeps it, another G is a config change
        cfg["train"]["micro_batches"] = args.invariant
    g = cfg["train"].get("micro_batches", 0)
    checked_number(g, file="config.json", field="train.micro_batches", lo=0, hi=2**20, error=BadInput)
    if g and g % world:
        raise BadInput("the micro-batches of a world-size-invariant step do not divide among the ranks",
                       expected=f"train.micro_batches a multiple of the world size {world}", found=g,
                       hint="choose G (--invariant G) as a multiple of every world size the run may use, e.g. 8")
    # The run's experiment config: its config.json (a fork or a pivot writes it), else the config.json beside
    # the generation --resume names. A change is refused here, before anything is built or restored (it is not
    # damage: no generation is skipped for it); without either file the generation's own config is the reference.
    reference = run_dir / "config.json" if args.run is not None else None
    if (reference is None or not os.path.lexists(reference)) and args.resume is not None:
        reference = Path(args.resume).parent / "config.json"
    run_config = None
    if reference is not None and os.path.lexists(reference):
        run_config = load_config_file(reference, run_file=True)
    # precision and CPU threads decide the trajectory: recorded in config.json, compared like the experiment
    # config (docs/ENGINE.md, "Precision and threads")
    cfg["train"]["precision"] = resolve_precision(args.precision, cfg, run_config, device, reference)
    cfg["train"]["threads"] = resolve_threads(args.threads, cfg, run_config, device, reference)
    if run_config is not None:
        assert reference is not None
        changed = config_changes(runtime_reference(run_config, cfg), cfg, OPERATIONAL_CONFIG)
        if changed and not args.allow_config_change:
            err = config_change_error(changed, reference, against=f"the run's {reference.name}")
            runtime = [k for k in changed if k in ("train.precision", "train.threads")]
            if runtime:  # the way on for a flag: the recorded value, or knowingly another
                flags = " and ".join(f"--{k.partition('.')[2]}" for k in runtime)
                recorded = " ".join(f"--{k.partition('.')[2]} {changed[k]['saved']}" for k in runtime
                                    if changed[k]["saved"] is not None)
                err.hint = (f"for an exact resume, resume without {flags}: the run's recorded "
                            f"{recorded or 'values'} apply (docs/ENGINE.md, \"Precision and threads\"); {err.hint}")
            raise err
    t = cfg["train"]
    micro_batches = int(t.get("micro_batches", 0))  # G: world-size-invariant steps (docs/ENGINE.md, "World size")

    # ---- data: the arms and the bandit that mixes them -------------------------
    notes: list[dict[str, Any]] = []
    # a new run: nothing to resume and no run config (a run's config.json, a mirror's, --resume's)
    new_run = args.resume is None and run_config is None and not (args.run is not None and _has_generation(run_dir))
    arms = load_arms(list(cfg["data"]["sources"]), notes, new_run=new_run)
    dropped = {n["arm"] for n in notes}
    policy = MixturePolicy.from_dict({k: {a: v for a, v in cfg["mixture"].get(k, {}).items() if a not in dropped}
                                      for k in ("floors", "caps")})
    seed = int(t["seed"])
    # Seed every global stream, even those this engine does not draw from: an
    # unseeded one differs between processes, and the verifier compares them all.
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # crop offsets: rank r draws from PCG64(seed) jumped r times (rank 0: the single-process stream)
    data_gen = rank_generator(seed, rank) if group else np.random.Generator(np.random.PCG64(seed))
    mix_gen = np.random.Generator(np.random.PCG64(seed + 1))  # the bandit's arm draws
    from .sources import CropSampler

    mconf = from_config_dict(cfg["model"])
    if args.run is not None:
        check_model_fits_run(run_dir, mconf.param_count())
    sampler = CropSampler(arms, mconf.block_size, t["batch_size"], data_gen)
    mixture = BanditMixture(list(arms), policy, mix_gen, phase=checked_number(cfg["mixture"].get("phase", 0), file="config.json", field="mixture.phase", lo=0, hi=2**31 - 1, error=BadInput))

    # ---- model, optimizer, schedule, mixed precision ----------------------------
    model = GPT(mconf).to(device)
    audit_on = args.audit and bool(cfg["audit"].get("enabled", True))
    # The sample audit's own instance (rank 0 of a replicated model without buffers): it samples each
    # generation from the staged copy of its weights, on the writer's thread, off the loop. A deep copy
    # draws from no random stream. A sharded run (a collective forward) samples the live model on the
    # loop, on every rank (docs/ENGINE.md, "The sample audit").
    audit_model = None
    if audit_on and rank == 0 and args.shard != "fsdp" and next(model.buffers(), None) is None:
        audit_model = copy.deepcopy(model).requires_grad_(False)
    forward = model  # what the training step calls: the model, or its DDP wrapper
    if group:
        if rank > 0:
            # Every rank built the same initial weights (same seed); from here on
            # each rank's global streams (dropout masks) are its own.
            random.seed(rank_seed(seed, rank))
            np.random.seed(rank_seed(seed, rank) % 2**32)
            torch.manual_seed(rank_seed(seed, rank))
        if args.shard == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (world,))
            for block in model.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif world > 1 and not micro_batches:  # invariant steps sum the gradients themselves: no DDP wrapper
            from torch.nn.parallel import DistributedDataParallel

            forward = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = model.configure_optimizer(lr_at(0, t), t["weight_decay"], tuple(t["betas"]), device.type)
    # The LR schedule is a pure function of (step, config) — `lr_at` — applied
    # before every step, so it has no state of its own to save: the optimizer's
    # param groups (saved) hold the LR in use, and a fork that overrides
    # train.lr or the schedule takes effect at its first step.
    # the step's precision (resolved above, recorded as train.precision): autocast to bf16 or fp16 on either
    # device; fp16 scales the loss with a GradScaler whose state is saved and restored with the rest
    amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[t["precision"]]
    scaler = torch.amp.GradScaler(device.type) if amp_dtype == torch.float16 else None

    # ---- the state ripresa saves, and the session over the run folder ------------
    mixture_slot = MixtureSlot(mixture)
    state = TrainingState(
        model=model, optimizer=optimizer, scaler=scaler,
        data=SamplerSlot(sampler, strict=not dropped and not args.allow_config_change),
        rng=RandomStreams(numpy={"data": data_gen, "mixture": mix_gen}),
        objects={"mixture": mixture_slot}, config=cfg, config_ignore=OPERATIONAL_CONFIG,
        code_files=[Path(__file__), Path(__file__).with_name("model.py"), Path(__file__).with_name("sources.py")],
        data_identity=sampler.data_identity(), device=str(device),
    )
    audit_cfg = cfg["audit"]
    samples_doc: dict[str, Any] = {"phase": mixture.phase, "audits": []}
    if args.run is not None:
        samples_doc = read_samples(run_dir, mixture.phase)

    def sample(step: int, net: GPT) -> None:
        """The audit of generation ``step``: fixed prompts, a generator of its own, into ``.samples.json``."""
        out = audit_samples(net, audit_cfg, seed, step, device, amp_dtype)
        samples_doc["audits"] = [a for a in samples_doc["audits"] if a["step"] < step] + [{"step": step, "samples": out}]
        if rank == 0:
            write_samples(run_dir, samples_doc)

    def audit(step: int) -> None:  # on_checkpoint: on the loop, the live model (a sharded one: every rank)
        if not audit_on:
            return
        if rank != 0 and args.shard != "fsdp":
            return  # a replicated model: rank 0 samples alone (a sharded forward needs every rank)
        sample(step, model)

    def audit_staged(step: int, weights: Any) -> None:  # on_staged: the committed weights into the audit's model
        assert audit_model is not None
        with torch.no_grad():
            for name, p in audit_model.named_parameters():
                p.copy_(weights[name])
        sample(step, audit_model)

    def export_at_deadline(step: int) -> dict[str, Any]:  # the deadline's export bundle (docs/CADENCE.md)
        from ...tools.export import export_run
        from .factory import GPT_FACTORY

        return export_run(run_dir, run_dir / "exports" / f"deadline-step_{step:06d}", model_factory=GPT_FACTORY,
                          step=step, show_progress=False)

    ckpt = Checkpointer(
        run_dir, state, every="auto" if args.every == "auto" else t["every"], asynchronous=args.asynchronous,
        mtbf=args.mtbf, max_redo=args.max_redo, on_deadline=export_at_deadline,
        deadline=None if args.deadline is None else datetime.fromtimestamp(args.deadline, UTC),
        on_checkpoint=audit if audit_model is None else None,
        on_staged=audit_staged if audit_model is not None else None, sidecars={STATE_NAME: mixture.state_dict},
        allow_version_change=args.allow_version_change, allow_code_change=args.allow_code_change,
        allow_data_change=args.allow_data_change or bool(dropped), mirror=args.mirror,
        final_upload_timeout=args.final_upload_timeout,
        # config.json, checked above, is the run's experiment config: a generation saved under another one (before
        # a fork or a pivot) is resumed and the difference recorded; without it, a change is refused unless allowed.
        allow_config_change=True if run_config is not None or args.allow_config_change else False,
        # the ANDREA .bin whenever the state fits it (docs/FORMAT.md, "Which format a session writes"); FSDP2: .dcp
        format="andrea" if args.shard != "fsdp" and bin_suits(state) is None else "auto",
        hyperparameters="loop",  # apply_hyperparameters() sets the config's values after the resume
        memory_every=args.memory_every,  # a generation in /dev/shm every K steps (docs/TIERS.md)
        world_size_invariant=micro_batches,  # the same trajectory on any number of ranks (docs/ENGINE.md)
        probe_every=args.probe_every,  # a side process replays every K-th checkpoint (docs/VERIFY.md, "The live probe")
    )
    try:
        for note in notes:
            ckpt.history.append(note)
        if args.run is not None and rank == 0:  # the flags `pivot --restart` relaunches with (docs/ENGINE.md)
            local = os.environ.get("LOCAL_WORLD_SIZE", "") if group else "1"
            local_world = int(local) if local.isdigit() and int(local) >= 1 else world
            ckpt.history.event("launch", **launch_record(args, world, local_world))
        start = ckpt.resume(from_path=args.resume, restore_rng=not args.omit_rng_restore)
        dist_ctx: DistContext | None = ckpt.dist
        if dist_ctx is not None and ckpt.world_change is not None:
            # A rank the saved run did not have starts fresh streams; the bandit's
            # stream is shared by all ranks, so every rank takes rank 0's.
            mix_gen.bit_generator.state = dist_ctx.broadcast(mix_gen.bit_generator.state)
        for z in mixture.dropped_arms:
            ckpt.history.event("zombie_arm", arm=z["arm"], pulls=z.get("pulls"), ema_reward=z.get("ema_reward"),
                               reason="bandit state names a source this run does not have")
        if mixture_slot.skipped_for_pivot is not None:
            ckpt.history.event("bandit_fresh", reason="pivot", saved_phase=mixture_slot.skipped_for_pivot,
                               phase=mixture.phase, policy=policy.to_dict())
        from ...text import escape_terminal, wrap_words

        def say(*a: Any, **k: Any) -> None:  # --quiet only hides the progress bar; a config's name comes from a file
            if rank == 0:
                print(*(escape_terminal(x) for x in a), **k)
        # --run: --steps is the run's end step; --output (the verify contract): this process's steps.
        if args.steps is None:
            goal = t["max_steps"]
        else:
            goal = start + args.steps if args.output is not None else args.steps
        origin = ckpt.resumed_from
        where_from: Any = origin.path if origin is not None else args.resume
        if ckpt.resumed_from_memory and origin is not None:  # promoted from /dev/shm (docs/TIERS.md)
            where_from = f"the memory tier ({origin.path.name})"
        if start >= goal and args.output is None:  # one line: where the run is, and how to go on
            import shlex

            asked = f"--steps {goal}" if args.steps is not None else f"train.max_steps={goal}"
            say(f"run {run_dir} is already at step {start}" + (f" (resumed from {where_from})" if start else "")
                + f": nothing to train to {asked}; for more: ripresa train --run {shlex.quote(str(run_dir))} "
                f"--steps {start + (args.steps or t['every'] or 100)}")
            ckpt.close()
            return 0
        if start:  # every resume says so, with the generation it started from
            say(f"resumed {run_dir} at step {start} from {where_from}")
        floor_warning = lr_floor_warning(t, start)
        if floor_warning is not None and rank == 0:  # once per start, on the console and in the history
            print(f"ripresa train: warning: {floor_warning}", file=sys.stderr, flush=True)
            ckpt.history.event("lr_below_floor", step=start, lr=float(t["lr"]), min_lr=float(t["min_lr"]))
        n_params = sum(p.numel() for p in model.parameters())
        where = f"{device}" if not group else f"{world} rank(s) on {device.type} ({args.shard}, {tdist.get_backend()})"
        where += f", {t['precision']}" + (f", {t['threads']} thread(s)" if t["threads"] is not None else "")
        say(wrap_words(f"ripresa train: {cfg['name']} ({n_params:,} parameters) on {where}, steps {start}→{goal}, "
            f"checkpoint every {'auto (docs/CADENCE.md)' if ckpt.cadence else t['every']} → {run_dir}"))  # 80 columns
        traj = None
        if args.output is not None:
            eval_loss = evaluate(model, sampler, device, amp_dtype)  # every rank: a sharded forward is collective
            # summary.json (the verify contract) observes full parameters: rank 0 of a replicated
            # model; a sharded (FSDP2) run writes none.
            if rank == 0 and not (group and args.shard == "fsdp"):
                traj = Trajectory(state, resumed_from=str(args.resume) if args.resume else None,
                                  rng_restored=not args.omit_rng_restore)
                traj.start(ckpt.progress, {"loss": eval_loss})
        apply_hyperparameters(optimizer, t, start)
        stopped = train_loop(forward, optimizer, scaler, amp_dtype, device, sampler, mixture, ckpt,
                             start, goal, t, traj, args.quiet or rank != 0, model=model)
        gen = None
        if args.output is not None and not stopped:
            gen = ckpt.save_now("final")
        last = ckpt.progress.step
        if args.output is not None:
            eval_loss = evaluate(model, sampler, device, amp_dtype)
            if traj is not None:
                traj.finish(ckpt.progress, {"loss": eval_loss})
                traj.saved(_gen_name(gen) if gen is not None else f"step_{last:06d}.bin")
                traj.write(run_dir / "summary.json")
    except BaseException:
        ckpt.abort()  # no collective on an error path: another rank may be gone
        raise
    closed = ckpt.close()  # a normal end: saves the last step when no generation holds it yet, waits for the mirror
    done = ckpt.deadline.done if ckpt.deadline is not None else None
    why = "stopped for the deadline" if done else "stopped by signal" if stopped else "done"
    if done:
        say(f"deadline: {'met' if done['met'] else 'MISSED'}, {done['seconds_before_deadline']:.1f} s before it; "
            f"export bundle {done.get('export')} (ripresa export --verify DIR)")
    say(f"{why} at step {last}; checkpoints, .loss.jsonl, "
        f"{SAMPLES_NAME}, {STATE_NAME} in {run_dir}")
    closed.raise_if_pending()  # UploadPending, exit 3: the final generation is not off this machine (docs/MIRROR.md)
    return 0


#: The ``ripresa train`` options recorded in the ``launch`` history event and replayed by ``pivot --restart``.
LAUNCH_OPTIONS = ("config", "sets", "sources", "steps", "every", "device", "audit", "asynchronous", "quiet", "threads",
                  "allow_version_change", "allow_code_change", "allow_data_change", "shard", "mirror", "mtbf",
                  "max_redo", "deadline", "memory_every", "invariant", "probe_every")


def launch_record(args: TrainArgs, world: int, local_world: int) -> dict[str, Any]:
    """What this process was asked, resolved: the ``launch`` history event (docs/ENGINE.md, "Restart after a pivot")."""
    from ...io import auth
    from ...io.redact import redact_url

    opts: dict[str, Any] = {}
    for name in LAUNCH_OPTIONS:
        value = getattr(args, name)
        opts[name] = list(value) if isinstance(value, tuple) else value
    if opts["deadline"] is not None:
        opts["deadline"] = datetime.fromtimestamp(opts["deadline"], UTC).isoformat()
    if isinstance(opts["mirror"], str):  # a path is recorded absolute: a restart may start elsewhere
        opts["mirror"] = redact_url(opts["mirror"]) if "://" in opts["mirror"] else os.path.abspath(opts["mirror"])
    opts["require_signature"] = auth.require_signature_from_env()
    return {"command": "ripresa train", "options": opts, "world_size": world, "local_world_size": local_world}


def _has_generation(run_dir: Path) -> bool:
    """Whether the folder holds a file named like a generation (a resume, not a new run, whatever its state)."""
    try:
        return any(e.name.startswith("step_") for e in os.scandir(run_dir))
    except OSError:
        return False


def _gen_name(gen: Any) -> str:
    """``step_NNNNNN.bin`` or ``step_NNNNNN.dcp`` of a generation."""
    path = getattr(gen, "bin", None) if not hasattr(gen, "kind") else gen.path
    return path.name if path is not None else str(gen)


def audit_samples(net: GPT, audit_cfg: dict[str, Any], seed: int, step: int, device: torch.device,
                  amp_dtype: torch.dtype | None) -> list[dict[str, str]]:
    """The completions of the audit's prompts by ``net`` at ``step`` (its own generator, never a training stream)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    out = []
    for prompt in list(audit_cfg["prompts"]):
        idx = torch.tensor([list(prompt.encode())], dtype=torch.long, device=device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            y = net.generate(idx, audit_cfg["max_new_tokens"], generator=gen,
                             temperature=audit_cfg["temperature"], top_k=audit_cfg["top_k"])
        out.append({"prompt": prompt, "completion": bytes(y[0, idx.size(1):].tolist()).decode("utf-8", "replace")})
    return out


@torch.no_grad()
def evaluate(model: GPT, sampler: Any, device: torch.device, amp_dtype: torch.dtype | None) -> float:
    """Mean loss over a fixed batch of each arm (own generator, eval mode): the run's evaluation output."""
    gen = np.random.Generator(np.random.PCG64(20260924))
    was = model.training
    model.eval()
    losses = []
    T = sampler.block_size
    for src in sampler.sources.values():
        offs = gen.integers(0, len(src) - T, size=4, dtype=np.int64)
        buf = torch.from_numpy(src.data[offs[:, None] + np.arange(T + 1)].astype(np.int64)).to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            _, loss = model(buf[:, :-1], buf[:, 1:])
        losses.append(float(loss.item()))
    model.train(was)
    return float(sum(losses) / len(losses))


def apply_hyperparameters(optimizer: torch.optim.Optimizer, t: dict[str, Any], step: int) -> None:
    """Set the config's hyper-parameters on the (possibly restored) param groups.

    For an exact resume these are the values already restored (a no-op); for
    a fork or a pivot with overrides, the new values apply from the next step.
    Group 0 decays, group 1 (biases, LayerNorms) does not.
    """
    for i, g in enumerate(optimizer.param_groups):
        g["lr"] = lr_at(step, t)
        g["weight_decay"] = float(t["weight_decay"]) if i == 0 else 0.0
        g["betas"] = (float(t["betas"][0]), float(t["betas"][1]))


def progress_columns(width: int, *, deadline: bool) -> list[Any]:
    """The training progress line's columns for a terminal ``width`` columns wide: every number whole on one line.

    From 120 columns: a bar and long labels; narrower: no bar, short labels
    (``54/200 · loss 3.2145 · 12.3/s · ckpt 12s · stop 3600s``), which fit 80
    columns with six-digit step counts (docs/CADENCE.md, "Deadline": the stop column).
    """
    from rich.table import Column

    def text(fmt: str) -> Any:
        return TextColumn(fmt, table_column=Column(no_wrap=True))

    wide = width >= 120
    columns: list[Any] = [text("[bold]train[/]")]
    if wide:
        columns.append(BarColumn(bar_width=40 if width >= 140 else 20))
    columns += [MofNCompleteColumn(table_column=Column(no_wrap=True)), text("loss {task.fields[loss]}"),
                text("{task.fields[rate]} steps/s" if wide else "{task.fields[rate]}/s"),
                text(("next ckpt" if wide else "ckpt") + " {task.fields[next]}")]
    if deadline:  # the time left to the planned stop (docs/CADENCE.md, "Deadline")
        columns.append(text(("planned stop in" if wide else "stop") + " {task.fields[stop]}"))
    columns.append(TimeElapsedColumn(table_column=Column(no_wrap=True)))
    return columns


def train_loop(forward, optimizer, scaler, amp_dtype, device, sampler, mixture, ckpt, start, goal, t, traj, quiet,
               model=None) -> bool:
    """Steps ``start+1 .. goal``; returns True when stopped by a signal.

    ``forward`` is what the step calls (the model, or its DDP wrapper);
    ``model`` the module whose parameters are clipped (default: ``forward``).
    """
    model = forward if model is None else model
    dist_ctx = ckpt.dist
    world = dist_ctx.world_size if dist_ctx is not None else 1
    steps = ckpt.invariant  # world-size-invariant steps: G micro-batches of batch_size crops (docs/ENGINE.md)
    samples_per_step = t["batch_size"] * (steps.G if steps is not None else world)  # the global batch (docs/ENGINE.md)
    tokens_per_step = samples_per_step * sampler.block_size
    from rich import get_console

    columns = progress_columns(get_console().width, deadline=ckpt.deadline is not None)
    last_t, last_step = time.perf_counter(), start
    rate = 0.0
    with Progress(*columns, disable=quiet, transient=False) as bar:
        task = bar.add_task("train", total=goal, completed=start, loss="—", rate="—", next="—", stop="—")
        for step in range(start + 1, goal + 1):
            arm = mixture.choose()
            lr = lr_at(step - 1, t)  # the LR of this update (pure function of the step)
            for g in optimizer.param_groups:
                g["lr"] = lr
            if steps is not None:  # the step's tree mean: the same on every rank, for any world size
                offsets, loss_value = invariant_step(steps, forward, optimizer, scaler, amp_dtype, device, sampler,
                                                     arm, step, t)
            else:
                x, y, offsets = sampler.batch(arm)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    _, loss = forward(x, y)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.unscale_(optimizer)
                else:
                    loss.backward()
                if t["grad_clip"]:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip"])
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                loss_value = float(loss.item())
                if dist_ctx is not None:
                    loss_value = dist_ctx.mean(loss_value)  # the bandit is shared: every rank updates it alike
            mixture.update(arm, loss_value)
            if traj is not None:
                traj.step(step, rows=offsets, lr=lr, loss=loss_value, arm=arm)
            stop = ckpt.step_done(step, loss=loss_value, lr=lr, arm=arm, tokens=tokens_per_step,
                                  samples=samples_per_step)
            last_t, last_step, rate = _show(bar, task, ckpt, step, goal, stop, loss_value, last_t, last_step, rate)
            if stop:
                return True
    return False


def _show(bar, task, ckpt, step, goal, stop, loss_value, last_t, last_step, rate):
    """Refresh the progress line at most twice a second (and at a stop or the end)."""
    now = time.perf_counter()
    if now - last_t >= 0.5 or stop or step == goal:
        rate = (step - last_step) / (now - last_t) if now > last_t else 0.0
        last_t, last_step = now, step
        nxt = ckpt.steps_to_next_checkpoint()
        eta = f"{nxt / rate:.0f}s" if nxt is not None and rate > 0 else "—"
        left = ckpt.deadline.seconds_to_stop() if ckpt.deadline is not None else None
        bar.update(task, completed=step, loss=f"{loss_value:.4f}", rate=f"{rate:.1f}", next=eta,
                   stop="—" if left is None else f"{max(0.0, left):.0f}s")
    return last_t, last_step, rate


def micro_batch_generator(seed: int, step: int, index: int) -> np.random.Generator:
    """The crop offsets of micro-batch ``index`` of ``step``: a function of the global index, never of the rank."""
    return np.random.Generator(np.random.PCG64([int(seed), int(step), int(index)]))


def invariant_step(steps, forward, optimizer, scaler, amp_dtype, device, sampler, arm, step, t):
    """One world-size-invariant step (docs/ENGINE.md, "World size"): this rank's micro-batches, each drawn and run
    by its global index, summed in the fixed tree; returns the step's crop offsets (this rank's) and mean loss."""
    optimizer.zero_grad(set_to_none=True)
    offsets: list[int] = []
    for i in steps.indices():
        with steps.micro_batch(step, i):
            x, y, off = sampler.batch(arm, generator=micro_batch_generator(t["seed"], step, i), count=False)
            offsets += off
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                _, loss = forward(x, y)
            steps.backward(loss, scaler=scaler)
    loss_value = steps.reduce()
    sampler.count(arm, steps.G)
    if scaler is not None:
        scaler.unscale_(optimizer)
    if t["grad_clip"]:
        steps.clip_grad_norm_(t["grad_clip"])
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return offsets, loss_value
