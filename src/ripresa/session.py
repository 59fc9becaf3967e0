"""The :class:`Checkpointer` session: exact, crash-safe checkpoints for any training loop.

Five added lines in a loop::

    ckpt = ripresa.Checkpointer("runs/my-run", state, every=100)   # state: a TrainingState
    start = ckpt.resume()                  # 0 for a new run; else restores everything, RNG last
    for step in range(start + 1, total + 1):
        loss = train_one_step(...)
        if ckpt.step_done(step, loss=loss):  # history, cadence, signals, sample audit
            break                            # SIGTERM/SIGINT: checkpoint written, stop
    ckpt.close()

Each checkpoint is a generation of the run folder's :class:`~ripresa.store.CheckpointStore`
(``step_NNNNNN.bin`` + companion + marker), written asynchronously by default.

Failed saves: a save that fails (full disk, I/O error) is reported as a
warning and a ``checkpoint_failed`` history event, training goes on and the
next cadence retries — the previous generation is intact, so at most one
cadence of work is at risk, and a transient condition (a disk briefly full)
does not kill a run that may have days left. After ``max_failed_saves``
consecutive failures the session raises :class:`~ripresa.errors.SaveFailed`
and the run stops with its last valid checkpoint. A save requested by
SIGTERM that fails always raises: the operator asked for a durable stop.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .async_save import AsyncCheckpointWriter
from .bin_state import bin_arrays, companion_snapshot, join_state
from .errors import BadInput, SaveFailed
from .formats.andrea_bin import (
    describe_missing,
    load_into_model_and_adamw,
    parse_bin_name,
    read_bin,
)
from .fsio import write_atomic
from .history import HISTORY_NAME, History
from .retention import DEFAULT_RETENTION, RetentionPolicy
from .signals import SignalRequests
from .state import Progress, TrainingState
from .store import CheckpointStore, CheckpointWarning, Generation


class ForeignCheckpointWarning(UserWarning):
    """A .bin without companion was resumed: weights, m, v only."""


class Checkpointer:
    """A training session over a run folder.

    Args:
        run_dir: the run folder (created if needed; locked for this process).
        state: the run's :class:`~ripresa.TrainingState` (model + AdamW required).
        every: checkpoint cadence in optimizer steps (0 = only on signals and at close).
        asynchronous: stage at the step boundary, write in the background.
        retention: which generations to keep.
        on_checkpoint: called as ``on_checkpoint(step)`` at every checkpoint
            (the sample-audit hook; it must not perturb the training streams).
        sidecars: ``{file name: callable returning a JSON-able dict}`` written
            atomically beside each checkpoint (e.g. ``.state.json``).
        handle_signals: install the SIGTERM/SIGINT/SIGUSR1 handlers.
        fresh: refuse a run folder that already holds checkpoints or history.
        allow_version_change, allow_code_change, allow_data_change: see
            :meth:`TrainingState.restore`.
        max_failed_saves: consecutive failed saves tolerated before raising.
    """

    def __init__(
        self,
        run_dir: str | Path,
        state: TrainingState,
        *,
        every: int = 100,
        asynchronous: bool = True,
        retention: RetentionPolicy = DEFAULT_RETENTION,
        on_checkpoint: Callable[[int], None] | None = None,
        sidecars: Mapping[str, Callable[[], dict[str, Any]]] | None = None,
        handle_signals: bool = True,
        fresh: bool = False,
        allow_version_change: bool = False,
        allow_code_change: bool = False,
        allow_data_change: bool = False,
        max_failed_saves: int = 3,
    ) -> None:
        if every < 0:
            raise BadInput("checkpoint cadence must be >= 0", expected="--every >= 0", found=every)
        self.run_dir = Path(run_dir)
        if fresh and self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise BadInput("--fresh refuses a run folder that is not empty", file=self.run_dir,
                           expected="an empty or new folder", found=sorted(p.name for p in self.run_dir.iterdir())[:8],
                           hint="choose a new --run folder, or drop --fresh to resume this one")
        self.state = state
        self.every = int(every)
        self.on_checkpoint = on_checkpoint
        self.sidecars = dict(sidecars or {})
        self.allow = {"allow_version_change": allow_version_change, "allow_code_change": allow_code_change,
                      "allow_data_change": allow_data_change}
        self.max_failed_saves = max_failed_saves
        self.store = CheckpointStore(self.run_dir, retention=retention)
        self.history = History(self.run_dir / HISTORY_NAME)
        if self.history.repaired_torn_line:
            self.history.event("torn_line_terminated")
        self.writer = AsyncCheckpointWriter(self.store) if asynchronous else None
        self.signals = SignalRequests().install() if handle_signals else SignalRequests()
        self.progress = Progress()
        self.failed_saves = 0
        self.last_saved_step: int | None = None
        self.resumed_from: Generation | None = None
        self._pending: tuple[int, str, float] | None = None  # (step, reason, t0) of the in-flight save
        self.save_stalls: list[float] = []  # seconds the loop was blocked by each save

    # ------------------------------------------------------------------ start
    def resume(self, *, from_path: str | Path | None = None, restore_rng: bool = True) -> int:
        """Restore the newest valid generation (or ``from_path``); return its step (0 if none).

        Call it after building every object and right before the first step:
        the random streams are restored last.
        """
        n = sum(p.numel() for p in self.state.model.parameters())
        if from_path is not None:
            src = Path(from_path)
            step = parse_bin_name(src.name)
            if step is None:
                raise BadInput("--resume needs a step_NNNNNN.bin", file=src, expected="step_NNNNNN.bin", found=src.name)
            companion = src.with_suffix(".json")
            if not companion.exists():
                return self._resume_foreign(src, n)
            reader = CheckpointStore(src.parent, writer=False)
            gen = reader.check(step, deep=False)
            if not gen.valid:
                from .errors import IntegrityError

                raise IntegrityError(f"cannot resume from generation {step}: {gen.reason}", file=src,
                                     hint="`ripresa inspect` shows the valid generations")
            store = reader
        else:
            store = self.store
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", CheckpointWarning)
                gen = store.latest_valid(deep=False)
            for w in caught:
                if issubclass(w.category, CheckpointWarning):
                    warnings.warn(str(w.message), CheckpointWarning, stacklevel=2)
                    self.history.event("skipped_generation", reason=str(w.message))
            if gen is None:
                self.history.event("start", step=0, rng_restored=restore_rng)
                self._write_config()
                return 0
        contents, comp = store.load(gen.step, expected_n=n)
        full = join_state(self.state, contents, comp)
        self.progress = self.state.restore(full, restore_rng=restore_rng, **self.allow)
        self.resumed_from = gen
        self.last_saved_step = gen.step if from_path is None else None
        self.history.event("resume", from_step=gen.step, file=str(gen.bin), rng_restored=restore_rng,
                           lineage=self.state.lineage[-1] if self.state.lineage else None)
        self._write_config()
        return self.progress.step

    def _resume_foreign(self, src: Path, n: int) -> int:
        contents = read_bin(src, expected_n=n)
        if self.state.optimizer is None:
            raise BadInput("a foreign .bin needs an AdamW optimizer to load m and v", file=src)
        notes = load_into_model_and_adamw(contents, self.state.model, self.state.optimizer)
        lacks = describe_missing(src)
        msg = (f"{src} has no companion: weights, m and v restored at step {contents.step}; data order and random "
               "streams start fresh, so this resume is only bit-equivalent modulo data randomness")
        warnings.warn(msg, ForeignCheckpointWarning, stacklevel=3)
        self.progress = Progress(step=contents.step)
        self.history.event("resume", from_step=contents.step, file=str(src), foreign=True, lacks=lacks, notes=notes)
        self._write_config()
        return contents.step

    def _write_config(self) -> None:
        write_atomic(self.run_dir / "config.json", [json.dumps(self.state.config, indent=2, default=str).encode() + b"\n"])

    # ------------------------------------------------------------------ each step
    def step_done(self, step: int, **metrics: Any) -> bool:
        """Record step ``step`` (just completed) and act on cadence and signals.

        Metrics go to the history line (``loss``, ``lr``, ``arm``, ...);
        ``tokens`` and ``samples`` also advance the progress counters and
        ``epoch`` sets it. Returns True when the loop must stop (a stop signal
        was handled: the checkpoint is committed).
        """
        p = self.progress
        p.step = int(step)
        if "tokens" in metrics:
            p.tokens_seen += int(metrics["tokens"])
        if "samples" in metrics:
            p.samples_seen += int(metrics["samples"])
        if "epoch" in metrics:
            p.epoch = int(metrics["epoch"])
        self.history.step(step, **metrics)
        self._collect(block=False)
        stop = self.signals.stop_requested
        asked = self.signals.take_checkpoint_request()
        if asked or stop:
            self.history.event("signal", step=step, signals=list(self.signals.received), action="stop" if stop else "checkpoint")
            self.signals.received.clear()
        due = self.every > 0 and step % self.every == 0
        if due or asked or stop:
            self._save(step, "stop" if stop else "signal" if asked else "cadence", must_succeed=stop)
        if stop:
            self._collect(block=True, must_succeed=True)
            return True
        return False

    def steps_to_next_checkpoint(self) -> int | None:
        if self.every <= 0:
            return None
        return self.every - (self.progress.step % self.every)

    # ------------------------------------------------------------------ saving
    def save_now(self, reason: str = "manual") -> Generation | None:
        """Checkpoint the current step synchronously (waits for the commit)."""
        self._save(self.progress.step, reason, must_succeed=True)
        return self._collect(block=True, must_succeed=True)

    def _save(self, step: int, reason: str, must_succeed: bool) -> None:
        if self.last_saved_step == step and self._pending is None:
            return  # this exact state is already committed
        t0 = time.perf_counter()
        try:
            arrays = bin_arrays(self.state)
            companion = companion_snapshot(self.state, self.progress)
            if self.writer is not None:
                self._collect(block=True, must_succeed=must_succeed)
                self.writer.save(step, arrays, companion)
                self._pending = (step, reason, t0)
                self.save_stalls.append(time.perf_counter() - t0)
            else:
                gen = self.store.save(step, arrays, companion)
                self.save_stalls.append(time.perf_counter() - t0)
                self._committed(gen, reason, time.perf_counter() - t0)
        except SaveFailed as exc:
            self._failed(step, exc, must_succeed)
            return
        for name, fn in self.sidecars.items():
            write_atomic(self.run_dir / name, [json.dumps(fn(), indent=1, allow_nan=True).encode() + b"\n"])
        if self.on_checkpoint is not None:
            self.on_checkpoint(step)  # runs while the background writer writes

    def _collect(self, *, block: bool, must_succeed: bool = False) -> Generation | None:
        """Account for a finished (or, with ``block``, the in-flight) background save."""
        if self.writer is None or self._pending is None:
            return None
        if not block and self.writer.in_flight:
            return None
        step, reason, t0 = self._pending
        self._pending = None
        try:
            gen = self.writer.wait()
        except SaveFailed as exc:
            self._failed(step, exc, must_succeed)
            return None
        if gen is not None:
            self._committed(gen, reason, self.writer.last_write_s)
        return gen

    def _committed(self, gen: Generation, reason: str, seconds: float) -> None:
        self.failed_saves = 0
        self.last_saved_step = gen.step
        self.history.event("checkpoint", step=gen.step, reason=reason, file=gen.bin.name, bytes=gen.size,
                           seconds=round(seconds, 4))
        self.history.sync()

    def _failed(self, step: int, exc: SaveFailed, must_succeed: bool) -> None:
        self.failed_saves += 1
        self.history.event("checkpoint_failed", step=step, error=exc.message, found=str(exc.found)[:200])
        if must_succeed or self.failed_saves >= self.max_failed_saves:
            raise exc
        warnings.warn(f"checkpoint at step {step} failed (training goes on; next cadence retries):\n{exc}", stacklevel=3)

    # ------------------------------------------------------------------ end
    def close(self, *, final_save: bool = False) -> None:
        """Finish the in-flight save (and optionally save the last step), release the folder."""
        try:
            self._collect(block=True, must_succeed=True)
            if final_save and self.last_saved_step != self.progress.step:
                self._save(self.progress.step, "final", must_succeed=True)
                self._collect(block=True, must_succeed=True)
        finally:
            try:
                self.history.sync()
            except OSError:
                pass
            self.history.close()
            self.signals.uninstall()
            self.store.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                if self.writer is not None and self._pending is not None:
                    self.writer.wait()  # never leave a half-written generation behind by choice
            except Exception:
                pass
            self.history.close()
            self.signals.uninstall()
            self.store.close()

