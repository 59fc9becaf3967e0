"""Asynchronous saves: a short copy at the step boundary, the rest in the background (docs/FORMAT.md).

Weights, m and v are copied into preallocated staging buffers (pinned on CUDA) — the only stall —
and a background thread commits the generation while training goes on ("Saving in the
background"). At most one save is in flight; a background failure is raised at the next
:meth:`AsyncCheckpointWriter.poll`, :meth:`~AsyncCheckpointWriter.save` or
:meth:`~AsyncCheckpointWriter.wait` as :class:`~ripresa.errors.SaveFailed`, the previous generation
untouched; the thread is not a daemon, so an exiting process lets the in-flight save complete.
A call given to :meth:`~AsyncCheckpointWriter.submit` as ``after`` runs on that thread once the
commit succeeded, while the staged copy is still intact (docs/API.md, ``on_staged``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import RipresaError, SaveFailed
from ..formats.andrea_bin import BinArrays
from ..formats.generation import Generation
from .store import CheckpointStore


class StagingBuffers:
    """One preallocated float32 buffer of 3·n elements: weights | m | v."""

    def __init__(self, n_params: int, *, pin_memory: bool | None = None) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.n_params = int(n_params)
        self.flat = torch.empty(3 * self.n_params, dtype=torch.float32, pin_memory=pin_memory)

    def capture(self, arrays: BinArrays) -> BinArrays:
        """Copy the live regions into the buffers; return views of the copies."""
        n = arrays.n_params
        if n != self.n_params:
            raise SaveFailed("the model changed size since the staging buffers were allocated",
                             expected=self.n_params, found=n)
        any_cuda = False
        for r, region in enumerate((arrays.weights, arrays.m, arrays.v)):
            off = r * n
            for chunk in region:
                t = chunk if isinstance(chunk, torch.Tensor) else torch.from_numpy(chunk)
                k = t.numel()
                dst = self.flat[off : off + k].view(t.shape)
                any_cuda |= t.device.type == "cuda"
                dst.copy_(t.detach(), non_blocking=t.device.type == "cuda")
                off += k
        if any_cuda:
            torch.cuda.synchronize()
        return BinArrays((self.flat[:n],), (self.flat[n : 2 * n],), (self.flat[2 * n :],))


class AsyncCheckpointWriter:
    """Background writer over a :class:`CheckpointStore`; one save in flight at most."""

    def __init__(self, store: CheckpointStore, *, pin_memory: bool | None = None) -> None:
        self.store = store
        self.pin_memory = pin_memory
        self.buffers: StagingBuffers | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_step: int | None = None
        self._result: Generation | None = None
        self.last_stall_s = 0.0  # seconds the caller was blocked by the last save() (wait + copy)
        self.last_write_s = 0.0  # seconds the last background write took (capture to commit, ``after`` excluded)
        #: ``(step, exception)`` of each ``after`` call that raised: never a save failure; the caller reports them
        self.after_errors: list[tuple[int, BaseException]] = []

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, step: int, arrays: BinArrays, companion_state: dict[str, Any]) -> None:
        """Stage ``arrays`` now and commit generation ``step`` in the background."""
        t0 = time.perf_counter()
        staged = self.stage(arrays)
        self.submit(step, lambda: self.store.save(step, staged, companion_state))
        self.last_stall_s = time.perf_counter() - t0

    def stage(self, arrays: BinArrays) -> BinArrays:
        """Wait for the in-flight save, then copy ``arrays`` into the staging buffers (the step boundary's bytes)."""
        self.wait()
        if self.buffers is None or self.buffers.n_params != arrays.n_params:
            self.buffers = StagingBuffers(arrays.n_params, pin_memory=self.pin_memory)
        return self.buffers.capture(arrays)

    def submit(self, step: int, write: Callable[[], Generation], *, after: Callable[[], Any] | None = None) -> None:
        """Run ``write`` (a backend's captured save of ``step``) in the background; one in flight at most.

        ``after``, if given, runs on the same thread once ``write`` committed (not after a failed
        write), before the save counts as finished: :meth:`wait`, :meth:`stage` and the next
        :meth:`submit` wait for it too, so the staging buffers it may read are not overwritten
        meanwhile. What it raises goes to :attr:`after_errors`, never to the save.
        """
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(step, write, after), name=f"ripresa-save-{step}",
                                        daemon=False)
        self._thread.start()

    def _run(self, step: int, write: Callable[[], Generation], after: Callable[[], Any] | None = None) -> None:
        t0 = time.perf_counter()
        try:
            self._result = write()
        except BaseException as exc:  # kept and raised in the training thread
            self._error, self._error_step = exc, step
            return
        finally:
            self.last_write_s = time.perf_counter() - t0
        if after is not None:
            try:
                after()
            except BaseException as exc:  # the generation is committed: reported by the caller, not a failed save
                self.after_errors.append((step, exc))

    def poll(self) -> None:
        """Raise the failure of a finished background save, if any (cheap; call each step)."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread.join()
            self._thread = None
            self._raise_pending()

    def wait(self) -> Generation | None:
        """Block until the in-flight save (if any) is committed; return it or raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_pending()
        result, self._result = self._result, None
        return result

    def _raise_pending(self) -> None:
        if self._error is None:
            return
        exc, step = self._error, self._error_step
        self._error = self._error_step = None
        if isinstance(exc, RipresaError):
            raise SaveFailed(
                f"background save of step {step} failed: {exc.message}",
                file=exc.file, expected=exc.expected, found=exc.found,
                hint=(exc.hint or "") + "; the previous generation is intact",
            ) from exc
        raise SaveFailed(f"background save of step {step} failed: {type(exc).__name__}: {exc}",
                         hint="the previous generation is intact") from exc

    def close(self) -> Generation | None:
        """Finish the in-flight save (the exit path)."""
        return self.wait()
