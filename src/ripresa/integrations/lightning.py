"""Exact resume inside Lightning's ``Trainer``: one callback (docs/INTEGRATIONS_lightning.md).

::

    from ripresa.integrations.lightning import ExactResume
    trainer = Trainer(max_steps=1000, callbacks=[ExactResume("runs/x", every=20)])
    trainer.fit(model, datamodule)      # run the same command again after a kill: it goes on, bitwise

:class:`ExactResume` owns save and resume through a :class:`~ripresa.Checkpointer`. What it saves and
when each hook acts: docs/INTEGRATIONS_lightning.md, "What ExactResume restores" and "Signals under the Trainer".
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.combined_loader import CombinedLoader

from ..core.loader import make_exact
from ..core.state import TrainingState
from ..errors import BadInput, SchemaError
from ..session.checkpointer import Checkpointer
from ..session.closing import CloseResult, warn_if_pending
from ..session.signals import hold

__all__ = ["ExactResume"]

#: ``state_dict()["format"]`` of the train loaders' positions and of the loop state.
DATA_FORMAT = "ripresa.lightning.train_loaders/1"
LOOPS_FORMAT = "ripresa.lightning.loops/1"


class _TrainLoaders:
    """The positions of the train loader(s) Lightning builds — a ``Stateful`` that exists before they do.

    ``resume()`` runs at ``on_fit_start``, before ``fit_loop.setup_data()``
    builds the loaders: a loaded position waits in :attr:`pending` until
    :meth:`attach` gets the loaders made exact (``on_train_start``).
    """

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.pending: list[Any] | None = None

    def attach(self, handles: list[Any]) -> None:
        if self.pending is not None:
            if len(self.pending) != len(handles):
                raise SchemaError("the checkpoint holds the position of another number of train loaders",
                                  expected=len(handles), found=len(self.pending),
                                  hint="return the same train loader(s) from train_dataloader() as the run that saved")
            for handle, saved in zip(handles, self.pending, strict=True):
                handle.load_state_dict(saved)  # refuses another data set, order or batch size
        self.handles, self.pending = handles, None

    def state_dict(self) -> dict[str, Any]:
        loaders = self.pending if self.pending is not None else [h.state_dict() for h in self.handles]
        return {"format": DATA_FORMAT, "loaders": list(loaders)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if (not isinstance(state, Mapping) or state.get("format") != DATA_FORMAT
                or not isinstance(state.get("loaders"), list | tuple)
                or not all(isinstance(s, Mapping) for s in state["loaders"])):
            raise SchemaError("train loader positions are malformed", expected=f"{DATA_FORMAT} with a list of positions",
                              found=state.get("format") if isinstance(state, Mapping) else type(state).__name__)
        self.pending = [dict(s) for s in state["loaders"]]
        if self.handles:  # already built (a resume inside a running fit): apply now
            self.attach(self.handles)


class _Loops:
    """Lightning's loop state, through the loops' own ``state_dict()``/``load_state_dict()``.

    ``trainer.fit_loop.state_dict()`` holds the epoch progress, the epoch
    loop's batch progress, the optimizer-step progress (``trainer.global_step``)
    and the logging step (``_batches_that_stepped``, in the epoch loop's
    ``on_save_checkpoint``). Lightning has no public setter for those
    counters one by one; its loops' ``state_dict``/``load_state_dict`` pair is
    what its own checkpoint restore uses, so ripresa uses it too.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {"format": LOOPS_FORMAT, "fit_loop": self.trainer.fit_loop.state_dict(),
                "global_step": int(self.trainer.global_step),
                "pl_global_seed": os.environ.get("PL_GLOBAL_SEED")}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if (not isinstance(state, Mapping) or state.get("format") != LOOPS_FORMAT
                or not isinstance(state.get("fit_loop"), Mapping)):
            raise SchemaError("Lightning loop state is malformed", expected=LOOPS_FORMAT,
                              found=state.get("format") if isinstance(state, Mapping) else type(state).__name__)
        seed = os.environ.get("PL_GLOBAL_SEED")
        if state.get("pl_global_seed") != seed:
            warnings.warn(f"the run was saved under seed_everything({state.get('pl_global_seed')}), this process "
                          f"called seed_everything({seed}): the restored random streams are the saved ones",
                          stacklevel=2)
        self.trainer.fit_loop.load_state_dict(dict(state["fit_loop"]))
        if int(self.trainer.global_step) != state.get("global_step"):
            raise SchemaError("Lightning's loop state did not restore global_step", expected=state.get("global_step"),
                              found=int(self.trainer.global_step),
                              hint="resume with the Lightning version and optimization mode of the run that saved")


def _scalar(value: Any) -> float | None:
    """A loss as a float (a tensor, a number, or a dict with ``loss``); None when there is none."""
    if isinstance(value, Mapping):
        value = value.get("loss")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _metric_retention(monitor: str, mode: str, save_top_k: int, other: Any) -> Any:
    """``ModelCheckpoint``'s ``monitor``/``mode``/``save_top_k`` as a retention policy (``other`` kept as well)."""
    from ..store.retention import KeepBest, KeepEvery, KeepLast, RetentionPolicy

    if not isinstance(save_top_k, int) or isinstance(save_top_k, bool) or save_top_k < -1:
        raise ValueError(f"save_top_k must be an int >= -1 (as ModelCheckpoint's), got {save_top_k!r}")
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max' (as ModelCheckpoint's), got {mode!r}")
    if save_top_k == -1:
        policy: RetentionPolicy = KeepEvery(1)  # every generation
    elif save_top_k == 0:
        policy = KeepLast(1)  # none but the newest, which a resume needs
    else:
        policy = KeepBest(monitor, k=save_top_k, mode=mode)
    if other is None:
        return policy
    if not isinstance(other, RetentionPolicy):
        raise TypeError(f"retention must be a ripresa.store.retention policy, not {type(other).__name__}")
    return other | policy


class ExactResume(Callback):
    """Exact save and resume of a Lightning ``fit()`` through a ripresa :class:`~ripresa.Checkpointer`.

    Args:
        run_dir: the run folder (as for ``Checkpointer``; ``ripresa verify``'s
            steering replaces it).
        every: checkpoint cadence in optimizer steps (``trainer.global_step``),
            0 (on signals and at the end only) or ``"auto"`` (docs/CADENCE.md).
        handle_signals: SIGTERM/SIGINT save at the next step boundary and stop
            the fit (``trainer.should_stop``); SIGUSR1 saves and goes on. They
            replace Lightning's own SIGTERM handling for the duration of the
            fit (its handlers come back after it).
        exact_loader: make the train loader(s) exact (default). ``False``
            leaves them as Lightning built them and saves no data position: the
            resume then is NOT exact — only for measuring what the loader's
            order and augmentation draws contribute (docs/INTEGRATIONS_lightning.md).
        seed: the base seed of the train loader's order and augmentation
            (``make_exact``'s ``seed``; default: the sampler's, else torch's
            initial seed, which ``seed_everything`` sets).
        monitor, mode, save_top_k: retention by a metric, as ``ModelCheckpoint``'s
            arguments of the same names: keep the ``save_top_k`` generations with
            the best ``monitor`` value (``mode="min"``: lowest; ``"max"``:
            highest), the value being ``trainer.callback_metrics[monitor]`` at the
            generation's step boundary (the latest logged or validated value).
            ``save_top_k=-1`` keeps every generation, ``0`` none but the newest.
            The newest generation is always kept for resume. Mapped onto
            ``KeepBest(monitor, k=save_top_k, mode=mode)``; a ``retention=`` given
            as well is kept too (``retention | KeepBest(...)``). Without
            ``monitor`` the ``Checkpointer``'s retention applies (docs/RETENTION.md).
        memory_every: also keep a complete generation of every ``memory_every``-th
            optimizer step in shared memory (``/dev/shm``; 0, the default: off):
            a SIGKILLed fit started again resumes from it when it is newer than
            the newest disk generation, so at most ``memory_every`` steps are
            lost. The copy runs on a thread; the next optimizer step waits for
            it (docs/INTEGRATIONS_lightning.md, "The memory tier"; docs/TIERS.md).
        probe_every: replay the first generation and then every
            ``probe_every``-th one in a side process (this script started
            again, resuming it) and compare the next step bit for bit with the
            fit's; a difference is one ``ProbeMismatchWarning`` line naming it
            (0, the default: off; docs/VERIFY.md, "The live probe").
        **checkpointer: other :class:`~ripresa.Checkpointer` options
            (``retention``, ``mirror``, ``deadline``, ``asynchronous``, ``mtbf``,
            ``max_redo``, ``allow_*_change``, ``save_on_close``, ``format``...).

    Attributes: :attr:`checkpointer` (during the fit), :attr:`resumed_step`
    (the step ``resume()`` returned, 0 for a new run), :attr:`close_result`
    (after the fit: what the session's ``close()`` returned) and
    :attr:`upload_pending` (the steps a ``mirror=`` still lacks after the fit:
    empty when the final state is safe off the machine; a ``CheckpointWarning``
    line says so when not, and ``sys.exit(callback.close_result.exit_code)``
    exits 3 as ``ripresa train`` does; docs/INTEGRATIONS_lightning.md).
    """

    def __init__(self, run_dir: str | Path, every: int | str = 100, *, handle_signals: bool = True,
                 exact_loader: bool = True, seed: int | None = None, monitor: str | None = None,
                 mode: str = "min", save_top_k: int = 1, memory_every: int = 0, probe_every: int = 0,
                 **checkpointer: Any) -> None:
        if every != "auto" and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
            raise ValueError(f"every must be an int >= 0 or 'auto', got {every!r}")
        if not isinstance(memory_every, int) or isinstance(memory_every, bool) or memory_every < 0:
            raise ValueError(f"memory_every must be an int >= 0 (0: no memory tier), got {memory_every!r}")
        checkpointer["memory_every"] = memory_every
        if not isinstance(probe_every, int) or isinstance(probe_every, bool) or probe_every < 0:
            raise ValueError(f"probe_every must be an int >= 0 (0: no probe), got {probe_every!r}")
        checkpointer["probe_every"] = probe_every
        self.monitor = monitor
        if monitor is not None:
            checkpointer["retention"] = _metric_retention(monitor, mode, save_top_k, checkpointer.get("retention"))
        clash = sorted(set(checkpointer) & {"state", "fresh", "distributed"})
        if clash:
            raise TypeError(f"ExactResume decides {clash} itself")
        self.run_dir = Path(run_dir)
        self.every = every
        self.handle_signals = bool(handle_signals)
        self.exact_loader = bool(exact_loader)
        self.seed = seed
        self.options = dict(checkpointer)
        self.checkpointer: Checkpointer | None = None
        self.resumed_step = 0
        self.close_result: CloseResult | None = None
        self._data: _TrainLoaders | None = None
        self._rng_after_resume: dict[str, Any] | None = None
        self._last_step: int | None = None
        self._failed = False

    # ------------------------------------------------------------------ building
    def _state(self, trainer: Trainer, pl_module: LightningModule) -> TrainingState:
        optimizers = list(trainer.optimizers)
        schedulers = [cfg.scheduler for cfg in trainer.lr_scheduler_configs]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        objects: dict[str, Any] = {"lightning_loops": _Loops(trainer)}
        # More than one optimizer or scheduler (manual optimization): the first as TrainingState's own, the others as objects.
        for i, opt in enumerate(optimizers[1:], start=1):
            objects[f"optimizer_{i}"] = opt
        for i, sched in enumerate(schedulers[1:], start=1):
            objects[f"lr_scheduler_{i}"] = sched
        self._data = _TrainLoaders() if self.exact_loader else None
        return TrainingState(model=pl_module, optimizer=optimizers[0] if optimizers else None,
                             scheduler=schedulers[0] if schedulers else None, scaler=scaler,
                             data=self._data, objects=objects)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.checkpointer is not None:  # a second fit() on this callback: the first session is over
            self.checkpointer.close()
            self.checkpointer = None
        self._failed, self._last_step, self._rng_after_resume = False, None, None
        self.close_result = None
        if self.handle_signals:
            hold()  # a SIGUSR1 before on_train_start is deferred, never fatal
        state = self._state(trainer, pl_module)
        # The signal handlers are installed at on_train_start: Lightning installs its own SIGTERM
        # handler after this hook (Trainer._run), and ripresa's must be the one in force.
        self.checkpointer = Checkpointer(self.run_dir, state, every=self.every, handle_signals=False, **self.options)
        try:
            self.resumed_step = self.checkpointer.resume()
            # The train loader's first iter() (fit_loop.setup_data, before it is exact) draws from the
            # global generators: on_train_start puts them back to what resume() restored.
            self._rng_after_resume = state.rng.state_dict() if self.resumed_step > 0 else None
            self._neutralise_ckpt_path(trainer)
        except BaseException:
            self.checkpointer.abort()
            self.checkpointer = None
            raise

    def _neutralise_ckpt_path(self, trainer: Trainer) -> None:
        """``fit(ckpt_path=...)`` beside ExactResume: after a ripresa resume, Lightning's checkpoint must not load over it.

        Lightning restores the optimizers, schedulers and loops of ``ckpt_path``
        after ``on_fit_start`` (``_checkpoint_connector.restore_training_state``,
        a private path with no public switch): the checkpoint it loaded is
        dropped here, so the resume stays the exact one. Without a ripresa
        generation (a new ripresa run folder) Lightning's checkpoint is left
        alone: it is the run's starting point.
        """
        if self.resumed_step > 0 and trainer.ckpt_path is not None:
            connector = getattr(trainer, "_checkpoint_connector", None)
            if connector is not None and getattr(connector, "_loaded_checkpoint", None):
                connector._loaded_checkpoint = {}
            warnings.warn(f"ExactResume resumed step {self.resumed_step} from {self.run_dir}; fit(ckpt_path="
                          f"{trainer.ckpt_path!r}) is not loaded over it (docs/INTEGRATIONS_lightning.md)", stacklevel=2)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        ckpt = self.checkpointer
        if ckpt is None:
            return
        if self._data is not None:
            loaders = trainer.train_dataloader
            flat = CombinedLoader(loaders).flattened if loaders is not None else []
            handles = [make_exact(dl, seed=self.seed) for dl in flat]
            self._data.attach(handles)
            # fit_loop.setup_data() already called iter() on the loader as Lightning built it (workers
            # started, indices prefetched from its old sampler): the fetcher must iterate the exact loader
            # from its position. Lightning has no public API to re-create its data fetcher's iterator.
            fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
            if fetcher is None:
                raise BadInput("Lightning's fit loop has no data fetcher at on_train_start",
                               hint="ExactResume supports lightning 2.x's fit loop (docs/INTEGRATIONS_lightning.md)")
            iter(fetcher)
        if self._rng_after_resume is not None:
            ckpt.state.rng.load_state_dict(self._rng_after_resume)  # last, right before the first step
        if self.handle_signals:
            ckpt.signals.install()  # over Lightning's SIGTERM handler; close() puts Lightning's back

    # ------------------------------------------------------------------ each step
    def _ending(self, trainer: Trainer) -> bool:
        """Whether the step just completed is the last one of this fit (max_steps, or the last batch of max_epochs)."""
        if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
            return True
        max_epochs = trainer.max_epochs
        last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        return max_epochs is not None and max_epochs >= 0 and bool(last_batch) and trainer.current_epoch + 1 >= max_epochs

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        ckpt = self.checkpointer
        if ckpt is None:
            return
        step = int(trainer.global_step)
        if step <= max(self.resumed_step, self._last_step or 0):
            return  # no optimizer step in this batch (gradient accumulation): not a step boundary
        self._last_step = step
        metrics: dict[str, Any] = {"epoch": int(trainer.current_epoch)}
        loss = _scalar(outputs)
        if loss is not None:
            metrics["loss"] = loss
        if self.monitor is not None:  # what ModelCheckpoint(monitor=...) reads: the latest logged/validated value
            value = _scalar(trainer.callback_metrics.get(self.monitor))
            if value is not None:
                metrics[self.monitor] = value
        if ckpt.step_done(step, **metrics):
            trainer.should_stop = True  # SIGTERM/SIGINT (or verify's cut): saved, the fit ends cleanly
            self._close(trainer)
        elif self._ending(trainer):
            self._close(trainer)  # the final save holds this step boundary, not the state after the fit's end hooks

    # ------------------------------------------------------------------ the end
    def _close(self, trainer: Trainer) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None:
            self.close_result = ckpt.close()  # with a mirror: waits for the store at a normal end (docs/MIRROR.md)
            warn_if_pending(self.close_result, "ExactResume")

    @property
    def upload_pending(self) -> list[int]:
        """The steps the mirror still lacks after the fit (empty: safe off the machine, or no mirror)."""
        return list(self.close_result.pending) if self.close_result is not None else []

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._failed:
            self._close(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._failed = True
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None:
            ckpt.abort()  # the live state may be half a step on: never saved

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.checkpointer is not None:  # a fit that had nothing left to train (resumed at max_steps)
            if self._failed:
                self.checkpointer.abort()
                self.checkpointer = None
            else:
                self._close(trainer)

    def state_dict(self) -> dict[str, Any]:
        """Nothing for Lightning's own checkpoints: the run folder holds ExactResume's state."""
        return {}

