"""Writing a general generation's tensor files: each file on its own worker, the staged tail, the live head.

:class:`TensorFileWriter` streams one safetensors file (one ``step_NNNNNN.safetensors``, or one shard)
into a :class:`~ripresa.io.fsio.StagedFile` on its own thread and says when its *live* head (the
tensors not copied into staging) is written: a save with a staging budget holds the training thread
until then only (docs/API.md, "Memory: staging_budget"). :func:`stage_tail` copies the tail that fits
the budget into one reused buffer. Protocol: docs/FORMAT.md.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..errors import SaveFailed
from ..formats import safetensors_file as st
from ..io.fsio import Digest, StagedFile

__all__ = ["StagingArea", "TensorFileWriter", "run_writers"]

Ordered = list[tuple[str, torch.Tensor]]


class TensorFileWriter:
    """One safetensors file written on its own thread: :meth:`start`, :meth:`wait_live`, :meth:`join`.

    ``live``: how many leading tensors of ``tensors`` (file order) are the live ones; the others are
    staged copies. ``overlap``: hash on the shared helper thread while writing (one file), or in this
    worker (files written side by side, one hash stream each).
    """

    def __init__(self, final: Path, tensors: Ordered, metadata: Mapping[str, str], *, live: int = 0,
                 overlap: bool = True) -> None:
        self.final, self.tensors, self.metadata = Path(final), tensors, dict(metadata)
        self.live, self.overlap = live, overlap
        self.file: StagedFile | None = None
        self.digest: Digest | None = None
        self.error: BaseException | None = None
        self._live_done = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> TensorFileWriter:
        self._thread = threading.Thread(target=self._run, name=f"ripresa-write-{self.final.name}", daemon=False)
        self._thread.start()
        return self

    def run_here(self) -> None:
        """Write the whole file in the calling thread (as :meth:`start` then :meth:`join` would, without a thread)."""
        self._thread = threading.current_thread()
        self._run()

    def _run(self) -> None:
        try:
            self.file = StagedFile(self.final, overlap=self.overlap)
            if self.live == 0:
                self._live_done.set()
            st.write(self.file, self.tensors, self.metadata, after=self._after)
            self.digest = self.file.finish()
        except BaseException as exc:  # raised by join(), in the committing thread
            self.error = exc
            if self.file is not None:
                self.file.discard()
        finally:
            self._live_done.set()

    def _after(self, i: int) -> None:
        if i + 1 >= self.live and not self._live_done.is_set():
            # The live tensors are hashed too before the loop may change them: a hash lagging behind the write
            # (``stable`` pieces) would otherwise read the next step's values (a committed file, a wrong sha256).
            assert self.file is not None
            self.file.settle()
            self._live_done.set()

    def wait_live(self) -> None:
        """Block until every live tensor is written (the staged ones may still be in flight)."""
        self._live_done.wait()

    def _join_thread(self) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def join(self) -> Digest:
        """Wait for the whole file (written and ``fsync``'d, not yet published); raise its failure."""
        self._join_thread()
        if self.error is not None:
            exc = self.error
            if isinstance(exc, SaveFailed):
                raise exc
            raise SaveFailed(f"writing {self.final.name} failed: {type(exc).__name__}: {exc}", file=self.final,
                             hint="the previous checkpoint is untouched") from exc
        assert self.digest is not None and self.file is not None
        return self.digest

    def discard(self) -> None:
        """After a failure elsewhere: wait for the thread, remove the temporary."""
        self._join_thread()
        if self.file is not None:
            self.file.discard()


def run_writers(writers: Sequence[TensorFileWriter]) -> list[Digest]:
    """Start (when not started) and join every writer; on any failure remove every temporary and raise it.
    One writer not yet started runs in the calling thread (no thread for one file)."""
    if len(writers) == 1 and not writers[0].started:
        writers[0].run_here()
    for w in writers:
        if not w.started:
            w.start()
    digests: list[Digest] = []
    try:
        for w in writers:
            digests.append(w.join())
    except BaseException:
        for w in writers:
            w.discard()
        raise
    return digests


#: Each staged tensor starts at a multiple of this many bytes of the staging buffer (a cache line).
STAGING_ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // STAGING_ALIGN) * STAGING_ALIGN


class StagingArea:
    """One reused buffer (pinned with CUDA) for the tail of a save's byte stream that fits the budget."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.staged: dict[str, torch.Tensor] = {}  # key -> its copy, of the last stage()

    def take(self, names: Mapping[str, str]) -> dict[str, torch.Tensor] | None:
        """``{name: staged copy}`` for ``names`` (name -> key) when every one was staged by the last :meth:`stage`."""
        if not all(k in self.staged for k in names.values()):
            return None
        return {n: self.staged[k] for n, k in names.items()}

    def stage(self, files: Sequence[Ordered], budget: int | None) -> tuple[list[Ordered], list[int]]:
        """Copy the largest tail (whole tensors, file order across ``files``) that fits ``budget`` bytes
        (None: everything) into the buffer; return the files with those tensors replaced by their copies,
        and how many leading tensors of each file stay live."""
        flat = [(f, i, t) for f, file in enumerate(files) for i, (_, t) in enumerate(file)]
        sizes = [_aligned(t.numel() * t.element_size()) for _, _, t in flat]
        first, staged = len(flat), 0
        while first > 0 and (budget is None or staged + sizes[first - 1] <= budget):
            first -= 1
            staged += sizes[first]
        if self.buffer is None or self.buffer.numel() < staged:
            self.buffer = None  # the old one is freed before the new one is allocated: one staging copy at most
            self.buffer = torch.empty(max(staged, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.staged = {}
        out = [list(file) for file in files]
        live = [len(file) for file in files]
        off, on_cuda = 0, False
        for (f, i, t), n in zip(flat[first:], sizes[first:], strict=True):
            # every copy starts on a cache line (a 4-byte step scalar before a 100 MB tensor would leave the
            # whole copy straddling lines: measurably slower than memcpy)
            k = t.numel() * t.element_size()
            dst = self.buffer[off: off + k].view(t.dtype).view(t.shape) if k else torch.empty(t.shape, dtype=t.dtype)
            on_cuda |= t.device.type == "cuda"
            dst.copy_(t, non_blocking=t.device.type == "cuda")
            out[f][i] = (out[f][i][0], dst)
            self.staged[out[f][i][0]] = dst
            live[f] = min(live[f], i)
            off += n
        if on_cuda:
            torch.cuda.synchronize()
        return out, live
