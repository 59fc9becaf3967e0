"""Tools on a generation that lives only in the store (docs/MIRROR.md, "Tools on a generation that lives only in
the store").

A multi-node run keeps on each node's disk only that node's shards: its generations are whole only in the
object store, laid out as a mirror's (docs/MIRROR.md, "Layout in the store"). ``ripresa inspect URL`` and
``ripresa export URL --to DEST`` take such a store: :func:`pulled` lands the newest committed generation (or
``--step N``'s) through the mirror's verified pull (every object checked against the marker, the whole
generation deep-checked before it lands) into a private temporary folder under ``$TMPDIR``, the tool runs on
it, and the folder is removed afterwards, on an error, Ctrl-C or SIGTERM too.

Only an explicit ``scheme://`` names a store (:func:`is_store_url`): a plain path keeps meaning a run folder or
a generation, as it always did.
"""

from __future__ import annotations

import re
import shutil
import signal
import tempfile
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput, CheckFailed, SaveFailed
from ..io.objstore import open_store
from ..io.redact import redact, redact_url
from ..store import mirror
from .report import fmt_short_size

#: ``scheme://`` at the start of an argument: a store URL, never a local path.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]{0,31}://")
#: The temporary folder's name prefix (a leftover of a SIGKILLed command is recognisable by it).
TEMP_PREFIX = "ripresa-store-"


def is_store_url(text: Any) -> bool:
    """True when ``text`` is a store URL (``s3://...``, ``file:///...``): a ``scheme://`` prefix, nothing else."""
    return isinstance(text, str) and _SCHEME.match(text) is not None


def local_path(text: str, what: str) -> Path:
    """``text`` as a local path (a command's PATH or RUN argument that is not a store URL)."""
    if not text:
        raise BadInput(f"empty {what}", expected="a path or a store URL (s3://bucket/prefix, file:///path)",
                       found=repr(text))
    return Path(text)


@dataclass(frozen=True)
class Pulled:
    """A generation landed from a store: where it came from and what the pull moved."""

    url: str  #: the store's URL, redacted (docs/MIRROR.md, "Trust")
    step: int
    kind: str
    path: Path  #: the generation's main file or folder in :attr:`run`
    run: Path  #: the temporary run folder it landed in (removed when :func:`pulled` ends)
    bytes: int  #: bytes downloaded (objects, marker, run files, config.json)
    objects: int  #: objects downloaded
    config: bool  #: config.json came with it

    def line(self, verb: str) -> str:
        """``inspecting step 6 from s3://b/p (pulled 1.2 MiB, 7 objects)``."""
        return (f"{verb} step {self.step} from {self.url} (pulled {fmt_short_size(self.bytes)}, "
                f"{self.objects} object{'s' if self.objects != 1 else ''})")

    def relabel(self, value: Any) -> Any:
        """``value`` (a report: dicts, lists, strings) with the temporary folder's path replaced by the store's URL:
        what a report names is where the bytes live, not a folder removed when the command ends."""
        prefix = str(self.run)
        if isinstance(value, str):
            return value.replace(prefix, self.url)  # a path, or a message quoting one
        if isinstance(value, dict):
            return {k: self.relabel(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.relabel(v) for v in value]
        return value


class _Counting:
    """An object store whose downloads are counted (bytes, objects); everything else passes through."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.bytes = 0
        self.objects = 0

    def get_into(self, key: str, out: Any, *, limit: int) -> int:
        n = self._inner.get_into(key, out, limit=limit)
        self.bytes += n
        self.objects += 1
        return n

    def get_bytes(self, key: str, *, limit: int) -> bytes:
        data = self._inner.get_bytes(key, limit=limit)
        self.bytes += len(data)
        self.objects += 1
        return bytes(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Terminated(KeyboardInterrupt):
    """SIGTERM during a pull: unwinds like Ctrl-C, so the temporary folder is removed (exit 2, "interrupted")."""


@contextmanager
def _term_unwinds() -> Iterator[None]:
    """SIGTERM raises :class:`_Terminated` meanwhile (main thread only; the previous handler is put back)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        raise _Terminated()

    before = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _warn_refused(refused: list[dict[str, Any]], url: str, step: int) -> None:
    """A :class:`~ripresa.store.commit.CheckpointWarning` for each newer generation this pull refused (its
    ``mirror_refused`` events; the first ``console.MAX_LISTED``, then a count)."""
    from ..console import capped_lines
    from ..store.commit import CheckpointWarning, not_used

    for line in capped_lines(refused, lambda e: not_used("generation", e["step"], redact(e.get("reason")), url,
                                                         then=f"step {step} is used"), what="refused generations"):
        warnings.warn(line, CheckpointWarning, stacklevel=3)


@contextmanager
def pulled(url: str, step: int | None = None) -> Iterator[Pulled]:
    """The newest committed generation of the store at ``url`` that verifies (or ``step``'s), landed in a private
    temporary folder for the duration of the ``with``; the folder is removed afterwards, whatever happens.

    Raises :class:`~ripresa.errors.CheckFailed` (exit 1) when the store holds no committed generation or none
    verifies, :class:`~ripresa.errors.BadInput` (exit 2) for a bad URL, an absent ``step``, missing credentials;
    a generation that failed its checks while an older one verified is named in a warning.
    """
    if step is not None and step < 0:
        raise BadInput("--step must be >= 0", found=step)
    shown = redact_url(url)
    remote = _Counting(open_store(url))  # a URL carrying credentials is refused here, redacted
    refused: list[dict[str, Any]] = []

    def seen(name: str, **kw: Any) -> None:  # this pull's refusals (never a restored history's old events)
        if name == "mirror_refused" and isinstance(kw.get("step"), int):
            refused.append(kw)

    with _term_unwinds():
        run = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))  # mode 0700: this user's alone
        try:
            try:
                gen, config = mirror.pull_generation(run, remote, step, event=seen)  # type: ignore[arg-type]
            except SaveFailed as exc:  # not enough space under $TMPDIR: say where more space is asked for
                if "disk space" not in exc.message:
                    raise
                raise SaveFailed(exc.message, file=exc.file, expected=exc.expected, found=exc.found,
                                 hint=f"the generation is pulled under $TMPDIR ({run.parent}); set TMPDIR to a folder "
                                 "on a disk with room for it") from None
            if gen is None:
                raise CheckFailed("the store holds no committed generation", file=shown,
                                  expected="at least one marker object (step_NNNNNN.*.sha256)", found="none",
                                  hint="check the URL (`ripresa mirror status RUN --mirror URL` lists a store)")
            _warn_refused(refused, shown, gen.step)
            yield Pulled(url=shown, step=gen.step, kind=gen.kind, path=gen.path, run=run, bytes=remote.bytes,
                         objects=remote.objects, config=config)
        finally:
            _remove(run)


def _remove(run: Path) -> None:
    """The temporary folder removed whole, Ctrl-C and SIGTERM held off meanwhile (delivered after it)."""
    held = {signal.SIGINT, signal.SIGTERM}
    masked = threading.current_thread() is threading.main_thread()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held) if masked else set()
    try:
        shutil.rmtree(run, ignore_errors=True)
    finally:
        if masked:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
