"""Text the byte-level GPT trains on (the bandit's *arms*), and random crops of it.

The built-in sources (``stdlib-code``, ``stdlib-docstrings``, ``pydoc-topics``) come from the Python
installation itself, deterministic for it and identified by :attr:`TextSource.sha256`; your own text
comes through :func:`load_text_source`. :class:`CropSampler` draws training batches from the
caller's generator and saves only counters. How the bytes are laid out and cut: docs/ENGINE.md,
"The model and its text".
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import platform
import re
import sysconfig
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...core.numbers import checked_number
from ...errors import BadInput, IdentityMismatch, MissingDependency, SchemaError

#: Names of the built-in sources, in the order a default mixture lists them.
BUILTIN_SOURCES = ("stdlib-code", "stdlib-docstrings", "pydoc-topics")

#: Default cap in bytes per built-in source, chosen so each builds in under
#: 2 s on one busy core. Reading 4 MiB of files takes ~0.05 s; docstrings
#: cost an ``ast.parse`` of ~5 bytes of source per byte kept, so 512 KiB of
#: them takes 0.7-1.5 s (1 MiB took 2-3.5 s on a loaded 2-core machine). The
#: pydoc topics are ~0.5 MB in all, under their cap.
DEFAULT_MAX_BYTES = {
    "stdlib-code": 4 << 20,
    "stdlib-docstrings": 512 << 10,
    "pydoc-topics": 4 << 20,
}

# Directories of the stdlib that are not the library itself, or that differ
# between two builds of the same Python version: installed packages, the test
# suites (huge and full of deliberately odd code), IDLE, caches, the build's
# config folder (config-3.11-x86_64-linux-gnu).
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "__pycache__"}
_SKIP_DIR_PREFIXES = ("config-",)
# Build-specific files: _sysconfigdata_*.py holds the compiler flags of this build.
_SKIP_FILE_PREFIXES = ("_sysconfigdata",)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True, eq=False)
class TextSource:
    """Bytes of one arm.

    Attributes:
        name: the arm's name (``stdlib-code``, or yours).
        data: uint8 ``[n]`` read-only array of the bytes served.
        sha256: hex digest of exactly ``data``'s bytes, the data identity.
        origin: where the bytes came from, for humans (not compared).
    """

    name: str
    data: np.ndarray
    sha256: str
    origin: str

    @classmethod
    def from_bytes(cls, name: str, raw: bytes, origin: str) -> TextSource:
        """Wrap ``raw`` (no copy: ``bytes`` are immutable) and hash it."""
        _check_name(name)
        data = np.frombuffer(raw, dtype=np.uint8)
        data.flags.writeable = False  # already read-only over bytes; make it explicit
        return cls(name=name, data=data, sha256=hashlib.sha256(raw).hexdigest(), origin=origin)

    def __len__(self) -> int:
        return int(self.data.size)

    def text(self, start: int = 0, stop: int | None = None) -> str:
        """``data[start:stop]`` decoded as UTF-8 (invalid bytes replaced), to show samples."""
        return self.data[start:stop].tobytes().decode("utf-8", errors="replace")


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise BadInput(
            "invalid data source name",
            expected="1-64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit",
            found=repr(name),
        )


def _check_cap(max_bytes: Any) -> int | None:
    if max_bytes is None:
        return None
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
        raise BadInput("max_bytes must be a positive int or None", expected=">= 1", found=repr(max_bytes))
    return max_bytes


def _header(rel: str) -> bytes:
    """The line that announces a file inside a concatenation."""
    return b"==> " + rel.encode("utf-8", errors="surrogateescape") + b" <==\n"


def _with_newline(content: bytes) -> bytes:
    return content if content.endswith(b"\n") else content + b"\n"


# ---- built-in sources ------------------------------------------------------------


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[str]:
    """Relative POSIX paths of the stdlib ``.py`` files the built-in sources read, sorted."""
    root = _stdlib_root()
    if not root.is_dir():
        raise BadInput("the Python standard library folder is missing", file=root,
                       hint="the stdlib-* sources need the .py files of the standard library")
    found: list[str] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(_SKIP_DIR_PREFIXES)]
        rel_folder = Path(folder).relative_to(root)
        for f in files:
            if f.endswith(".py") and not f.startswith(_SKIP_FILE_PREFIXES):
                found.append((rel_folder / f).as_posix())
    found.sort()  # os.walk order is the filesystem's; sort for determinism
    return found


def _origin_stdlib(what: str, used: int, total: int, size: int, cap: int | None) -> str:
    return (
        f"{what} of Python {platform.python_version()} stdlib at {_stdlib_root()}: "
        f"{used} of {total} files in sorted order, {size} bytes (cap {cap})"
    )


def _concat(root: Path, rels: Iterable[str], cap: int | None,
            body_of: Callable[[Path, str], bytes | None]) -> tuple[bytes, int]:
    """``# rel`` header + ``body_of(root, rel)`` for each file in order (None: skipped), up to ``cap``; (bytes, files used)."""
    parts: list[bytes] = []
    size = used = 0
    for rel in rels:
        if cap is not None and size >= cap:
            break
        body = body_of(root, rel)
        if body is None:
            continue
        chunk = _header(rel) + _with_newline(body) + b"\n"
        parts.append(chunk)
        size += len(chunk)
        used += 1
    return b"".join(parts)[:cap], used


def _build_stdlib(what: str, cap: int | None, body_of: Callable[[Path, str], bytes | None]) -> tuple[bytes, str]:
    root, files = _stdlib_root(), stdlib_files()
    raw, used = _concat(root, files, cap, body_of)
    return raw, _origin_stdlib(what, used, len(files), len(raw), cap)


def _build_stdlib_code(cap: int | None) -> tuple[bytes, str]:
    return _build_stdlib(".py source", cap, lambda root, rel: (root / rel).read_bytes())


def _docstrings(tree: ast.Module) -> list[str]:
    """Module docstring, then class/function docstrings in source order (depth first)."""
    out: list[str] = []

    def visit(node: ast.AST) -> None:
        doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
        if doc:
            out.append(doc)
        for child in node.body:  # type: ignore[attr-defined]
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child)

    visit(tree)
    return out


def _docstrings_of(root: Path, rel: str) -> bytes | None:
    try:
        with warnings.catch_warnings():  # invalid escapes etc. in old files: not our concern
            warnings.simplefilter("ignore")
            tree = ast.parse((root / rel).read_bytes(), filename=rel)
    except (SyntaxError, ValueError):
        return None  # deterministic: the same file fails the same way every time
    docs = _docstrings(tree)
    return "\n\n".join(docs).encode("utf-8", errors="backslashreplace") if docs else None


def _build_stdlib_docstrings(cap: int | None) -> tuple[bytes, str]:
    return _build_stdlib("docstrings", cap, _docstrings_of)


def _build_pydoc_topics(cap: int | None) -> tuple[bytes, str]:
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions split pydoc_data out
        raise MissingDependency(
            "the pydoc-topics source needs pydoc_data, which this Python lacks",
            found=str(e),
            hint="use another source, or install your distribution's python docs package",
        ) from None
    keys = sorted(topics)
    raw = b"".join(_header(k) + _with_newline(topics[k].encode("utf-8")) + b"\n" for k in keys)[:cap]
    origin = f"pydoc_data.topics of Python {platform.python_version()}: {len(keys)} topics in sorted order, {len(raw)} bytes (cap {cap})"
    return raw, origin


_BUILDERS = {
    "stdlib-code": _build_stdlib_code,
    "stdlib-docstrings": _build_stdlib_docstrings,
    "pydoc-topics": _build_pydoc_topics,
}


@functools.lru_cache(maxsize=16)
def _build_builtin(name: str, cap: int | None) -> TextSource:
    raw, origin = _BUILDERS[name](cap)
    if not raw:
        raise BadInput(f"data source '{name}' is empty on this Python", found=origin)
    return TextSource.from_bytes(name, raw, origin)


def builtin_source(name: str, max_bytes: int | None = None) -> TextSource:
    """A built-in source (:data:`BUILTIN_SOURCES`), built once per process and cap.

    ``max_bytes`` defaults to :data:`DEFAULT_MAX_BYTES`; ``None`` there means
    the default, not "no cap" — pass a large int to lift it.
    """
    if name not in _BUILDERS:
        raise BadInput(f"unknown built-in data source '{name}'", expected=list(BUILTIN_SOURCES), found=name,
                       hint="for your own text use load_text_source(name, path)")
    cap = _check_cap(max_bytes)
    return _build_builtin(name, DEFAULT_MAX_BYTES[name] if cap is None else cap)


# ---- your own text ---------------------------------------------------------------


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise BadInput("cannot read data file", file=path, found=e.strerror or str(e)) from None


def load_text_source(name: str, path: str | os.PathLike[str], max_bytes: int | None = None) -> TextSource:
    """Your text as an arm: a file's bytes, or a folder's files concatenated.

    A folder is walked recursively; hidden entries (``.git``, ...) and
    ``__pycache__`` are skipped, files are taken in sorted order of their
    relative POSIX paths, each preceded by a ``==> path <==`` line, and files
    containing a NUL byte (binary) are skipped. A single file is served as
    is, byte for byte; a binary one is refused. The result is cut at
    ``max_bytes`` (default: no cap). Not memoised: the file may change
    between two calls, and the sha256 tells.
    """
    _check_name(name)
    cap = _check_cap(max_bytes)
    p = Path(path)
    if not p.exists():
        raise BadInput(f"data source '{name}': path does not exist", file=p,
                       expected="a text file or a folder of text files")
    if p.is_file():
        raw = _read_file(p)
        if b"\0" in raw:
            raise BadInput(f"data source '{name}': file looks binary (contains NUL bytes)", file=p,
                           expected="text", hint="pass a text file, or a folder (binary files are skipped)")
        raw = raw[:cap]
        origin = f"file {p.resolve()}, {len(raw)} bytes (cap {cap})"
    elif p.is_dir():
        skipped = 0
        candidates: list[str] = []
        for folder, dirs, files in os.walk(p):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            rel_folder = Path(folder).relative_to(p)
            candidates.extend((rel_folder / f).as_posix() for f in files if not f.startswith("."))

        def text_of(root: Path, rel: str) -> bytes | None:
            nonlocal skipped
            if not (root / rel).is_file():
                return None  # a dangling link or a socket
            content = _read_file(root / rel)
            if not content or b"\0" in content:
                skipped += 1
                return None
            return content

        raw, used = _concat(p, sorted(candidates), cap, text_of)
        origin = f"folder {p.resolve()}: {used} text files in sorted order ({skipped} empty or binary skipped), {len(raw)} bytes (cap {cap})"
    else:
        raise BadInput(f"data source '{name}': not a regular file or folder", file=p)
    if not raw:
        raise BadInput(f"data source '{name}' is empty", file=p, expected="at least one byte of text",
                       found="no text (empty, or only binary files)")
    return TextSource.from_bytes(name, raw, origin)


def source_from_spec(spec: str) -> TextSource:
    """``"stdlib-code"`` (a built-in) or ``"name=path"`` (:func:`load_text_source`)."""
    if spec in _BUILDERS:
        return builtin_source(spec)
    name, sep, path = spec.partition("=")
    if not sep or not path:
        raise BadInput("bad data source", expected=f"one of {list(BUILTIN_SOURCES)} or NAME=PATH", found=repr(spec))
    return load_text_source(name, path)


def load_sources(specs: Iterable[str]) -> dict[str, TextSource]:
    """Several :func:`source_from_spec` at once, keyed by name; duplicate names are refused."""
    out: dict[str, TextSource] = {}
    for spec in specs:
        src = source_from_spec(spec)
        if src.name in out:
            raise BadInput(f"data source '{src.name}' given twice", found=spec)
        out[src.name] = src
    if not out:
        raise BadInput("no data source given", expected=f"at least one of {list(BUILTIN_SOURCES)} or NAME=PATH")
    return out


# ---- batches ---------------------------------------------------------------------


class CropSampler:
    """Random ``block_size``-byte windows of one arm per batch.

    Args:
        sources: arm name -> :class:`TextSource`; arms keep this order.
        block_size: ``T``, bytes per sequence.
        batch_size: ``B``, sequences per batch.
        generator: the NumPy generator the offsets are drawn from. Its state
            belongs to the caller's :class:`~ripresa.RandomStreams`; this
            object's :meth:`state_dict` holds only counters.

    A batch of arm ``a`` draws exactly ``B`` offsets with one
    ``generator.integers`` call, uniformly in ``[0, len(a) - T - 1]``: the
    window ``[o, o + T]`` (inclusive) is ``T + 1`` bytes, input ``x`` the first
    ``T`` and target ``y`` the last ``T``. So a resume that restores the
    generator draws the same next offsets, whichever arm is asked.
    """

    def __init__(
        self,
        sources: Mapping[str, TextSource],
        block_size: int,
        batch_size: int,
        generator: np.random.Generator,
    ) -> None:
        for label, value in (("block_size", block_size), ("batch_size", batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BadInput(f"CropSampler {label} must be a positive int", expected=">= 1", found=repr(value))
        if not isinstance(generator, np.random.Generator):
            raise BadInput("CropSampler needs a numpy Generator", expected="np.random.Generator",
                           found=type(generator).__name__, hint="np.random.default_rng(seed)")
        if not sources:
            raise BadInput("CropSampler needs at least one data source", expected="a non-empty mapping")
        for arm, src in sources.items():
            if not isinstance(src, TextSource):
                raise BadInput(f"arm '{arm}' is not a TextSource", found=type(src).__name__)
            if len(src) < block_size + 1:
                raise BadInput(
                    f"data source '{arm}' is shorter than one training window",
                    expected=f">= block_size + 1 = {block_size + 1} bytes",
                    found=f"{len(src)} bytes ({src.origin})",
                    hint="add text to this source, or use a smaller block_size",
                )
        self.sources = dict(sources)
        self.block_size = int(block_size)
        self.batch_size = int(batch_size)
        self.generator = generator
        self.batches: dict[str, int] = dict.fromkeys(self.sources, 0)  # batches served per arm
        self.tokens: dict[str, int] = dict.fromkeys(self.sources, 0)  # input bytes served per arm
        #: Arms of a loaded state that this sampler does not have (non-strict load only).
        self.dropped_arms: dict[str, dict[str, Any]] = {}

    @property
    def arms(self) -> tuple[str, ...]:
        return tuple(self.sources)

    def batch(self, arm: str, generator: np.random.Generator | None = None,
              count: bool = True) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``(x, y, offsets)``: int64 CPU tensors ``[B, T]`` with ``y[:, t] = x[:, t + 1]``'s next byte.

        Move them to the device yourself (``x.to(device, non_blocking=True)``). ``generator`` draws the
        offsets instead of the sampler's own (a world-size-invariant micro-batch's, seeded by its global
        index); ``count=False`` leaves the counters to :meth:`count`.
        """
        src = self.sources.get(arm)
        if src is None:
            raise BadInput(f"unknown data arm '{arm}'", expected=list(self.sources), found=arm,
                           hint="a bandit state from another run may name an arm this run lacks")
        T = self.block_size
        draw = self.generator if generator is None else generator
        offsets = draw.integers(0, len(src) - T, size=self.batch_size, dtype=np.int64)  # high exclusive
        window = offsets[:, None] + np.arange(T + 1, dtype=np.int64)  # [B, T+1] byte positions
        buf = torch.from_numpy(src.data[window].astype(np.int64))  # [B, T+1]
        x = buf[:, :-1].contiguous()
        y = buf[:, 1:].contiguous()
        if count:
            self.count(arm, 1)
        return x, y, [int(o) for o in offsets]

    def count(self, arm: str, batches: int) -> None:
        """Count ``batches`` batches of ``arm`` as served (a world-size-invariant step counts its G micro-batches
        on every rank, so the counters do not follow the number of ranks)."""
        self.batches[arm] += batches
        self.tokens[arm] += batches * self.batch_size * self.block_size

    def data_identity(self) -> dict[str, str]:
        """``{arm: sha256}`` of the bytes each arm serves."""
        return {arm: src.sha256 for arm, src in self.sources.items()}

    # -- Stateful -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Shape, and per arm: sha256, length, batches and tokens served (weights_only-safe)."""
        return {
            "block_size": self.block_size,
            "batch_size": self.batch_size,
            "arms": {
                arm: {
                    "sha256": src.sha256,
                    "length": len(src),
                    "batches": self.batches[arm],
                    "tokens": self.tokens[arm],
                }
                for arm, src in self.sources.items()
            },
        }

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Restore the counters.

        ``strict`` (the default, for an exact resume) refuses another
        ``block_size``/``batch_size``, another set of arms or an arm whose bytes
        changed. ``strict=False`` is for a deliberate change of data: saved arms
        this sampler lacks are dropped (kept in :attr:`dropped_arms`, never
        drawn again — the "zombie arm" lesson), new arms start at zero, and a
        changed arm keeps its counters.
        """
        check_sampler_state(state_dict, block_size=self.block_size if strict else None,
                            batch_size=self.batch_size if strict else None)
        saved: Mapping[str, Any] = state_dict["arms"]
        if strict:
            if set(saved) != set(self.sources):
                raise SchemaError(
                    "data arms differ from the checkpoint's",
                    expected=sorted(saved),
                    found=sorted(self.sources),
                    hint="pass the same data sources, or load non-strictly to change them on purpose",
                )
            changed = sorted(a for a in saved if saved[a]["sha256"] != self.sources[a].sha256)
            if changed:
                raise IdentityMismatch(
                    f"data of arm(s) {changed} changed since the checkpoint",
                    expected={a: saved[a]["sha256"] for a in changed},
                    found={a: self.sources[a].sha256 for a in changed},
                    hint="a different Python version ships a different stdlib; load non-strictly to accept",
                )
        self.dropped_arms = {a: dict(v) for a, v in saved.items() if a not in self.sources}
        for arm in self.sources:
            entry = saved.get(arm)
            self.batches[arm] = checked_number(entry["batches"], file=None, field=f"sources.{arm}.batches", lo=0,
                                               hi=2**63 - 1, error=SchemaError) if entry else 0
            self.tokens[arm] = checked_number(entry["tokens"], file=None, field=f"sources.{arm}.tokens", lo=0,
                                              hi=2**63 - 1, error=SchemaError) if entry else 0


#: The largest block or batch size a saved sampler state may name (far above any real run).
_MAX_SHAPE = 1 << 40


def check_sampler_state(state: Any, *, block_size: int | None = None, batch_size: int | None = None,
                        where: Any = None) -> None:
    """The one check of a saved mixture sampler state (types, ranges; with the sizes given, equal to them).

    Used by :meth:`MixtureSampler.load_state_dict` and, where no sampler is built
    (``ripresa export --verify`` of a bundle), through the GPT model factory:
    a :class:`SchemaError` naming the field, never a crash on a hostile value.
    """
    if not isinstance(state, Mapping):
        raise SchemaError("data sampler state is not a dict", file=where, found=type(state).__name__)
    for key in ("block_size", "batch_size", "arms"):
        if key not in state:
            raise SchemaError(f"data sampler state lacks '{key}'", file=where, expected=key, found=sorted(map(str, state)))
    for key, mine in (("block_size", block_size), ("batch_size", batch_size)):
        v = state[key]
        if type(v) is not int or not 1 <= v <= _MAX_SHAPE:
            raise SchemaError(f"data sampler state: {key} is not a size", file=where, expected=f"1..{_MAX_SHAPE}",
                              found=repr(v)[:80])
        if mine is not None and v != mine:
            raise SchemaError(f"data sampler was saved with {key}={v}, this run has {key}={mine}", file=where,
                              expected=mine, found=v, hint="resume with the same block and batch size")
    arms = state["arms"]
    if not isinstance(arms, Mapping):
        raise SchemaError("data sampler state: arms is not a dict", file=where, found=type(arms).__name__)
    for arm, entry in arms.items():
        if not isinstance(arm, str) or not isinstance(entry, Mapping) or not isinstance(entry.get("sha256"), str):
            raise SchemaError("data sampler state: an arm is not {sha256, length, batches, tokens}", file=where,
                              found=repr(arm)[:80])
        for key in ("length", "batches", "tokens"):
            v = entry.get(key)
            if type(v) is not int or not 0 <= v <= 1 << 62:
                raise SchemaError(f"data sampler state: arm {arm[:40]!r} {key} is not a count", file=where,
                                  expected=f"0..{1 << 62}", found=repr(v)[:80])
