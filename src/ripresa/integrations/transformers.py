"""Exact resume inside a Hugging Face ``transformers.Trainer``: one callback (docs/INTEGRATIONS_transformers.md).

::

    from ripresa.integrations.transformers import ExactResume
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[ExactResume("runs/x", every=20)])   # the one line
    trainer.train()          # a new run, or — the same command after a kill — its exact continuation

What it saves, its non-public API (marked ``# not public API:`` below) and what it refuses: docs/INTEGRATIONS_transformers.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

from ..core.loader import make_exact
from ..core.state import TrainingState
from ..errors import BadInput
from ..session.checkpointer import Checkpointer
from ..session.closing import CloseResult, warn_if_pending

__all__ = ["ExactResume"]

#: ``TrainerState`` fields that a run accumulates (the rest is recomputed from the arguments by every ``train()``).
_STATE_FIELDS = ("global_step", "epoch", "log_history", "total_flos", "num_input_tokens_seen", "best_metric",
                 "best_global_step", "best_model_checkpoint")


def _find_trainer() -> tuple[Trainer, Any]:
    """The ``Trainer`` whose loop calls this callback, and the ``resume_from_checkpoint`` its loop was given.

    not public API: ``TrainerCallback`` events do not receive the trainer; it is
    the ``self`` of ``Trainer._inner_training_loop`` up the call stack.
    """
    frame = sys._getframe(1)
    while frame is not None:
        me = frame.f_locals.get("self")
        if isinstance(me, Trainer) and frame.f_code.co_name == "_inner_training_loop":
            return me, frame.f_locals.get("resume_from_checkpoint")
        frame = frame.f_back
    raise RuntimeError("ExactResume: no transformers.Trainer training loop is calling this callback "
                       "(it works as a Trainer callback: Trainer(..., callbacks=[ExactResume(...)]))")


def _unwrap(obj: Any, attr: str) -> Any:
    """accelerate's ``AcceleratedOptimizer``/``AcceleratedScheduler`` wrap the torch object in ``.optimizer``/``.scheduler``."""
    inner = getattr(obj, attr, None)
    return inner if inner is not None and type(obj).__module__.startswith("accelerate.") else obj


class _TrainerBook:
    """The ``Trainer``'s own bookkeeping as a ``Stateful`` user object (the state, the loss accounting, callbacks)."""

    def __init__(self, trainer: Trainer, owner: ExactResume) -> None:
        self.trainer, self.owner = trainer, owner

    def _callbacks(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for cb in self.trainer.callback_handler.callbacks:
            if isinstance(cb, ExportableState) and cb is not self.owner:
                out.setdefault(type(cb).__name__, cb)
        return out

    def state_dict(self) -> dict[str, Any]:
        t, s = self.trainer, self.trainer.state
        book = {
            "state": {k: getattr(s, k) for k in _STATE_FIELDS},
            # not public API: the loss accounting of the running loop (module doc).
            "total_loss_scalar": float(t._total_loss_scalar),
            "globalstep_last_logged": int(t._globalstep_last_logged),
            "current_flos": float(t.current_flos),
            "callbacks": {name: cb.state() for name, cb in self._callbacks().items()},
        }
        # JSON keeps every float exactly (repr round-trips), NaN/inf included.
        return {"book": json.dumps(book, allow_nan=True), "tr_loss": t._tr_loss.detach().to("cpu", copy=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            book = json.loads(state["book"])
            tr_loss = state["tr_loss"]
            values = {k: book["state"][k] for k in _STATE_FIELDS}
            callbacks = book["callbacks"]
            numbers = (float(book["total_loss_scalar"]), int(book["globalstep_last_logged"]), float(book["current_flos"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadInput("the Trainer bookkeeping in the checkpoint is malformed", found=f"{type(exc).__name__}: {exc}",
                           hint="resume from a generation written by ripresa.integrations.transformers.ExactResume") from None
        if not isinstance(tr_loss, torch.Tensor) or tr_loss.numel() != 1:
            raise BadInput("the Trainer bookkeeping in the checkpoint is malformed", expected="a one-element tr_loss",
                           found=type(tr_loss).__name__)
        t, s = self.trainer, self.trainer.state
        for k, v in values.items():
            setattr(s, k, v)
        live = self._callbacks()
        for name, cb_state in callbacks.items():
            cb = live.get(name)
            if cb is not None and isinstance(cb_state, dict):
                for attr, v in dict(cb_state.get("attributes") or {}).items():
                    setattr(cb, attr, v)
        # not public API (module doc): the running loop's loss accounting, as the uninterrupted run has it.
        with torch.no_grad():
            t._tr_loss.copy_(tr_loss.reshape(t._tr_loss.shape).to(t._tr_loss.device, t._tr_loss.dtype))
        t._total_loss_scalar, t._globalstep_last_logged, t.current_flos = numbers
        t._initial_global_step = 0  # train_loss and the throughput cover the whole run, as uninterrupted
        t._initial_num_input_tokens_seen = 0


class ExactResume(TrainerCallback):
    """Make a ``transformers.Trainer`` run save and resume exactly in ``run_dir`` (module doc).

    Args:
        run_dir: the run folder (a :class:`~ripresa.Checkpointer` folder).
        every: checkpoint every this many optimizer steps (``"auto"``: docs/CADENCE.md;
            0: only on signals and at the end).
        seed: the base of the data order and every sample's augmentation; default
            ``args.data_seed`` if set, else ``args.seed`` (what the Trainer itself uses).
        exact_loader: make the Trainer's train loader exact (default). ``False``
            leaves it as the Trainer built it and saves no data position: the
            resume then is NOT exact (the epoch restarts, reshuffled, with new
            augmentation draws) — only for measuring what the loader's order and
            random draws contribute, e.g. as ``ripresa verify``'s negative case
            (docs/INTEGRATIONS_transformers.md).
        metric_for_best_model, greater_is_better, save_total_limit: retention as the
            ``TrainingArguments`` fields of the same names mean it (default: the
            ``TrainingArguments``' own values): keep the generation with the best
            ``eval_<metric>`` (the latest evaluation at or before its step;
            highest when ``greater_is_better``, whose default, as the Trainer's, is
            ``not metric.endswith("loss")``) and the ``save_total_limit`` newest —
            ``KeepLast(save_total_limit) | KeepBest("eval_<metric>", k=1, mode=...)``.
            Without ``save_total_limit`` the newest are kept as the ``Checkpointer``'s
            default retention keeps them (``KeepLast(3)``); the newest generation is
            always kept for resume. A ``retention=`` given as well is kept too
            (docs/INTEGRATIONS_transformers.md, docs/RETENTION.md).
        memory_every: also keep a complete generation of every ``memory_every``-th
            optimizer step in shared memory (``/dev/shm``; 0, the default: off):
            a SIGKILLed ``train()`` started again resumes from it when it is newer
            than the newest disk generation, so at most ``memory_every`` steps are
            lost. The copy runs on a thread while the next step's forward and
            backward run; its optimizer step waits for it
            (docs/INTEGRATIONS_transformers.md, "The memory tier"; docs/TIERS.md).
        probe_every: replay the first generation and then every
            ``probe_every``-th one in a side process (this script started
            again, resuming it) and compare the next step bit for bit with the
            fit's; a difference is one ``ProbeMismatchWarning`` line naming it
            (0, the default: off; docs/VERIFY.md, "The live probe").
        **checkpointer_kwargs: passed to :class:`~ripresa.Checkpointer` (``retention``,
            ``mirror``, ``deadline``, ``asynchronous``, ...).

    SIGTERM/SIGINT save the current step and stop the ``Trainer``
    (``control.should_training_stop``); SIGUSR1 saves and goes on. The last
    step is saved when ``train()`` ends. :attr:`checkpointer` is the session
    (None outside ``train()``), :attr:`resumed_step` the step the last
    ``train()`` resumed from (0: a new run). With ``mirror=``, the end waits
    for the store (``final_upload_timeout``); after ``train()``,
    :attr:`close_result` is what the session's ``close()`` returned and
    :attr:`upload_pending` the steps the mirror still lacks (empty: safe off
    the machine); a ``CheckpointWarning`` line says so when not, and
    ``sys.exit(callback.close_result.exit_code)`` exits 3 as ``ripresa train``
    does (docs/INTEGRATIONS_transformers.md).
    """

    def __init__(self, run_dir: str | Path, every: int | str = 100, *, seed: int | None = None,
                 exact_loader: bool = True, metric_for_best_model: str | None = None,
                 greater_is_better: bool | None = None, save_total_limit: int | None = None, memory_every: int = 0,
                 probe_every: int = 0, **checkpointer_kwargs: Any) -> None:
        if not isinstance(memory_every, int) or isinstance(memory_every, bool) or memory_every < 0:
            raise ValueError(f"memory_every must be an int >= 0 (0: no memory tier), got {memory_every!r}")
        checkpointer_kwargs["memory_every"] = memory_every
        if not isinstance(probe_every, int) or isinstance(probe_every, bool) or probe_every < 0:
            raise ValueError(f"probe_every must be an int >= 0 (0: no probe), got {probe_every!r}")
        checkpointer_kwargs["probe_every"] = probe_every
        self.run_dir, self.every, self.seed = run_dir, every, seed
        self.metric_for_best_model, self.greater_is_better = metric_for_best_model, greater_is_better
        self.save_total_limit = save_total_limit
        self._metric: str | None = None  # eval_<metric_for_best_model> when retention follows it
        self._metric_value: float | None = None  # its latest value (on_evaluate) in this train()
        self.exact_loader = bool(exact_loader)
        self.kwargs = checkpointer_kwargs
        self.checkpointer: Checkpointer | None = None
        self.resumed_step = 0
        self.close_result: CloseResult | None = None
        self._trainer: Trainer | None = None
        self._handle: Any = None
        self._pending: int | None = None  # the step whose log/eval/save is under way
        self._done = 0  # the last step handed to the Checkpointer
        self._wait_epoch_end = False  # step S's last Trainer call is the one after on_epoch_end
        self._per_epoch, self._ga = 1, 1  # batches an epoch, gradient accumulation (set by on_train_begin)

    # ------------------------------------------------------------------ start
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer, resume_from = _find_trainer()
        if resume_from is not None:
            raise BadInput("trainer.train(resume_from_checkpoint=...) and ripresa's ExactResume both resume the run",
                           found=str(resume_from),
                           hint="drop resume_from_checkpoint: ExactResume resumes the run folder "
                                f"{self.run_dir} itself, exactly (the Trainer's own resume skips batches without "
                                "their random state)")
        if args.world_size > 1:
            raise BadInput("ExactResume runs in a single process", found=f"world_size={args.world_size}",
                           hint="run the Trainer in one process, or use ripresa.Checkpointer in your own loop "
                                "(docs/INTEGRATIONS_transformers.md, limits)")
        loader = kwargs.get("train_dataloader")
        if loader is None:
            raise BadInput("the Trainer gave no train_dataloader to its callbacks", hint="pass train_dataset=")
        ga = int(args.gradient_accumulation_steps)
        seed = self.seed if self.seed is not None else (args.data_seed if args.data_seed is not None else args.seed)
        handle = make_exact(loader, seed=int(seed)) if self.exact_loader else None
        per_epoch = handle.batches_per_epoch if handle is not None else len(loader)
        if ga > 1 and per_epoch % ga:
            raise BadInput("ExactResume needs gradient_accumulation_steps to divide the batches of an epoch",
                           expected=f"a divisor of {per_epoch}", found=ga,
                           hint="the Trainer's loop-local counters decide the last, shorter accumulation of an "
                                "epoch; after a mid-epoch resume they would end it elsewhere")
        if self.checkpointer is not None:  # a train() that raised: its state may be mid-step, never saved
            self.checkpointer.abort()
            self.checkpointer = None
        self._trainer, self._handle, self._pending = trainer, handle, None
        self.close_result = None
        self._per_epoch, self._ga = per_epoch, ga
        model = trainer.model
        config: dict[str, Any] = {}
        if hasattr(model, "config") and hasattr(model.config, "to_json_string"):
            # what `ripresa export --inference` needs to write a from_pretrained folder (docs/INTEGRATIONS_transformers.md)
            config["transformers"] = {"model_class": type(model).__name__,
                                      "model_config": json.loads(model.config.to_json_string(use_diff=False))}
        ts = TrainingState(
            model=model,
            optimizer=_unwrap(trainer.optimizer, "optimizer"),
            scheduler=_unwrap(trainer.lr_scheduler, "scheduler"),
            scaler=getattr(trainer.accelerator, "scaler", None),
            data=handle,
            objects={"trainer": _TrainerBook(trainer, self)},
            config=config,
        )
        kwargs = dict(self.kwargs)
        retention = self._retention(args, kwargs.get("retention"))
        if retention is not None:
            kwargs["retention"] = retention
        ckpt = Checkpointer(self.run_dir, ts, every=self.every, **kwargs)
        try:
            start = ckpt.resume()
            if start and start >= state.max_steps:
                raise BadInput(f"the run in {ckpt.run_dir} is complete: it reached step {start} of max_steps="
                               f"{state.max_steps}", expected=f"max_steps > {start}", found=state.max_steps,
                               hint="raise max_steps to train on, or start a new run folder")
        except BaseException:
            ckpt.abort()
            raise
        self.checkpointer, self.resumed_step, self._done = ckpt, start, start
        # not public API (module doc): step S's state is captured after the Trainer logged/evaluated step S.
        original = trainer._maybe_log_save_evaluate
        if getattr(original, "_ripresa_owner", None) is not None:
            original = original._ripresa_original

        def after_log_save_evaluate(*a: Any, **kw: Any) -> Any:
            out = original(*a, **kw)
            self._after_step_logged()
            return out

        after_log_save_evaluate._ripresa_owner = self  # type: ignore[attr-defined]
        after_log_save_evaluate._ripresa_original = original  # type: ignore[attr-defined]
        trainer._maybe_log_save_evaluate = after_log_save_evaluate  # type: ignore[method-assign]

    def _retention(self, args: Any, other: Any) -> Any:
        """``metric_for_best_model`` / ``greater_is_better`` / ``save_total_limit`` as a retention policy, or None."""
        from ..store.retention import DEFAULT_RETENTION, KeepBest, KeepLast, RetentionPolicy

        metric = self.metric_for_best_model or getattr(args, "metric_for_best_model", None)
        limit = self.save_total_limit if self.save_total_limit is not None else getattr(args, "save_total_limit", None)
        self._metric, self._metric_value = None, None
        if metric is None and limit is None:
            return None
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise BadInput("save_total_limit must keep at least one generation", expected="an int >= 1",
                           found=limit, hint="the newest generation is always kept for resume")
        policy: RetentionPolicy = KeepLast(limit) if limit is not None else (other if other is not None else DEFAULT_RETENTION)
        if metric is not None:
            name = metric if metric.startswith("eval_") else f"eval_{metric}"  # as the Trainer looks it up
            greater = self.greater_is_better
            if greater is None and self.metric_for_best_model is None:
                greater = getattr(args, "greater_is_better", None)
            if greater is None:
                greater = not metric.endswith("loss")  # the Trainer's default
            policy = policy | KeepBest(name, k=1, mode="max" if greater else "min")
            self._metric = name
        if other is not None and limit is not None:
            if not isinstance(other, RetentionPolicy):
                raise TypeError(f"retention must be a ripresa.store.retention policy, not {type(other).__name__}")
            policy = other | policy
        return policy

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, Any] | None = None,
                    **kwargs: Any) -> None:
        if self._metric is not None and metrics and self._metric in metrics:
            try:
                self._metric_value = float(metrics[self._metric])
            except (TypeError, ValueError):
                self._metric_value = None

    # ------------------------------------------------------------------ each step
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        h = self._handle
        if self.checkpointer is None:
            return
        if h is None:  # exact_loader=False: the loader as the Trainer built it; the Trainer's own epoch
            self._pending = state.global_step
            self._wait_epoch_end = ((state.global_step * self._ga) % self._per_epoch == 0
                                    or control.should_training_stop or control.should_epoch_stop)
            return
        # The Trainer's epoch, from the true epoch and position (its own counters restart at a resume); the
        # Trainer's formula, epoch + (step + 1) / steps_in_epoch, so bitwise its value in an uninterrupted run.
        state.epoch = h.epoch + h.cursor / h.batches_per_epoch
        self._pending = state.global_step
        # The step's last Trainer call is the one after on_epoch_end when the epoch (or the run) ends here.
        self._wait_epoch_end = h.cursor >= h.batches_per_epoch or control.should_training_stop or control.should_epoch_stop

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._wait_epoch_end = False

    def _after_step_logged(self) -> None:
        step = self._pending
        ckpt, trainer = self.checkpointer, self._trainer
        if step is None or ckpt is None or trainer is None or self._wait_epoch_end:
            return
        self._pending = None
        if step <= self._done:
            return
        self._done = step
        epoch = self._handle.epoch if self._handle is not None else int(trainer.state.epoch or 0)
        metrics: dict[str, Any] = {"epoch": max(epoch, 0)}
        if self._metric is not None and self._metric_value is not None:  # the latest evaluation (retention)
            metrics[self._metric] = self._metric_value
        stop = ckpt.step_done(step, **metrics)
        if stop:  # SIGTERM/SIGINT (or ripresa verify's cut): step saved; the Trainer ends as at max_steps
            trainer.control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ckpt, trainer = self.checkpointer, self._trainer
        self.checkpointer = None
        if trainer is not None:
            wrapped = trainer.__dict__.get("_maybe_log_save_evaluate")
            if getattr(wrapped, "_ripresa_owner", None) is self:
                del trainer.__dict__["_maybe_log_save_evaluate"]
        if ckpt is not None:
            self.close_result = ckpt.close()  # with a mirror: waits for the store at a normal end (docs/MIRROR.md)
            warn_if_pending(self.close_result, "ExactResume")

    @property
    def upload_pending(self) -> list[int]:
        """The steps the mirror still lacks after ``train()`` (empty: safe off the machine, or no mirror)."""
        return list(self.close_result.pending) if self.close_result is not None else []
