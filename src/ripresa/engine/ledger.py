"""Batch inference that survives a kill: the ledger of completed items (``ripresa generate``).

What must survive a crash is *which items are already done*. The output file is the ledger (one
fsync'd JSON line per completed item, one locked writer, a torn tail truncated at start);
``OUT.meta.json`` binds it to the step, weights, inputs and settings, and a restart that differs is
refused. Each item samples from its own generator seeded from ``(step, id)`` (:func:`item_seed`), so a
resumed job writes what an uninterrupted one would. :func:`generate_batch` is the implementation; the
CLI calls it. Why a third kind of save: docs/ENGINE.md, "Pictures, comparisons, bundles, batch
inference"; format and guarantees: docs/FORMAT.md, "Batch-inference ledger".
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput, IntegrityError, LockHeld, RipresaError, SaveFailed
from ..io.fileops import describe_oserror as _describe_oserror
from ..io.fsio import (
    fsync_dir,
    is_temp_name,
    open_regular,
    open_run_file,
    ops,
    parse_json_bytes,
    read_json_small,
    read_small,
    temp_name_pid,
    write_atomic,
)
from ..io.lock import pid_alive

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "InputItem",
    "LedgerScan",
    "generate_batch",
    "item_seed",
    "main",
    "meta_path",
    "read_inputs",
    "scan_ledger",
]

FORMAT = "ripresa-ledger"
FORMAT_VERSION = 1
#: The keys of one ledger record, in the order they are written.
RECORD_KEYS = ("id", "input_sha256", "prompt", "completion", "step")
#: How each item's sampling seed is derived (recorded in the meta file).
SEED_RULE = "int.from_bytes(sha256(b'ripresa-ledger/v1 step=<step> id=<id>')[:8], 'little') >> 1"
#: Largest meta file read (bytes); a real one is a few KB.
_META_MAX = 1 << 20
#: Largest inputs file read into memory (bytes).
_INPUTS_MAX = 1 << 30
#: Longest prompt (one input line, bytes) and longest ledger record (one line, bytes). A
#: record holds its prompt JSON-escaped (at most 6 bytes per input byte) and a completion;
#: reading stops at the first longer line, so a hostile ledger (a sparse 1 GiB line) never
#: costs more memory than this.
_PROMPT_MAX = 8 << 20
_RECORD_MAX = 64 << 20

ItemHook = Callable[[str, int], None]


# ---- inputs ------------------------------------------------------------------------


@dataclass(frozen=True)
class InputItem:
    """One input: its line number (1-based), its text and the sha256 of its UTF-8 bytes."""

    id: int
    prompt: str
    sha256: str


def _read_all(fd: int, path: Path, what: str, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            chunk = os.read(fd, 1 << 20)
        except OSError as exc:
            raise BadInput(f"{what} could not be read", file=path, found=_describe_oserror(exc),
                           hint="check the disk and the file's permissions") from exc
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise BadInput(f"{what} is too large", file=path, expected=f"at most {limit} bytes",
                           found=f"more than {limit} bytes")
        chunks.append(chunk)


def read_inputs(path: str | Path) -> tuple[list[InputItem], str]:
    """The inputs of a batch: one prompt per line (UTF-8); returns (items, sha256 of the file).

    Every line is an input and its id is its line number (1-based); a final
    newline ends the last line (it does not start an empty one). ``\\r\\n``
    line ends are accepted (the ``\\r`` is not part of the prompt). Invalid
    UTF-8 is refused (:class:`~ripresa.errors.BadInput`, naming the line).
    """
    p = Path(path)
    fd = open_regular(p, "inputs file")
    try:
        raw = _read_all(fd, p, "inputs file", _INPUTS_MAX)
    finally:
        os.close(fd)
    file_sha = hashlib.sha256(raw).hexdigest()
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline that ends the last line
    items: list[InputItem] = []
    for i, line in enumerate(lines, start=1):
        if line.endswith(b"\r"):
            line = line[:-1]
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadInput("inputs file is not valid UTF-8", file=p, expected="one UTF-8 prompt per line",
                           found=f"line {i}, byte {exc.start}: {line[max(0, exc.start - 10):exc.start + 10]!r}",
                           hint="re-encode the file as UTF-8") from exc
        if len(line) > _PROMPT_MAX:
            raise BadInput("an input line is too long", file=p, expected=f"prompts of at most {_PROMPT_MAX} bytes",
                           found=f"line {i}: {len(line)} bytes", hint="split or shorten the prompt")
        items.append(InputItem(i, text, hashlib.sha256(line).hexdigest()))
    if not items:
        raise BadInput("inputs file has no lines", file=p, expected="one prompt per line", found="an empty file")
    return items, file_sha


def item_seed(step: int, item_id: int) -> int:
    """The sampling seed of item ``item_id`` at ``step`` (63 bits, see :data:`SEED_RULE`)."""
    digest = hashlib.sha256(f"ripresa-ledger/v1 step={int(step)} id={int(item_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# ---- the ledger on disk -------------------------------------------------------------


def meta_path(out: str | Path) -> Path:
    """``OUT`` → ``OUT.meta.json``, the file that binds the ledger to its job."""
    p = Path(out)
    return p.with_name(p.name + ".meta.json")


@dataclass
class LedgerScan:
    """What a ledger holds: complete records by id, and the torn tail (if any)."""

    records: dict[int, dict[str, Any]]
    complete_size: int  # bytes up to and including the last newline
    torn_bytes: int  # bytes after it (an incomplete record)


def _bad_record(out: Path, line_no: int, what: str, found: Any, hint: str | None = None) -> IntegrityError:
    return IntegrityError(
        f"ledger line {line_no}: {what}",
        file=out,
        expected="one complete record per line: " + ", ".join(RECORD_KEYS),
        found=found,
        hint=hint or "the ledger was edited or written by something else; keep it for inspection and "
        "write to a new --out file",
    )


def scan_ledger(data: bytes, out: Path, items: Sequence[InputItem] | None = None,
                step: int | None = None) -> LedgerScan:
    """Parse a ledger's bytes. Only lines that end with a newline are records.

    With ``items`` and ``step``, each record must match its input (prompt and
    sha256) and the step. Raises :class:`~ripresa.errors.IntegrityError` on a
    complete line that is not a valid record, and on a duplicate id.
    """
    last_nl = data.rfind(b"\n")
    complete_size = last_nl + 1
    records: dict[int, dict[str, Any]] = {}
    lines: dict[int, int] = {}
    if complete_size:
        for line_no, line in enumerate(data[:last_nl].split(b"\n"), start=1):
            rec = _parse_record(line, line_no, out)
            rid = rec["id"]
            if rid in records:
                raise _duplicate(out, rid, lines[rid], line_no)
            if items is not None:
                if not 1 <= rid <= len(items):
                    raise _bad_record(out, line_no, "id out of range", rid,
                                      hint=f"the inputs have {len(items)} lines")
                item = items[rid - 1]
                if rec["input_sha256"] != item.sha256 or rec["prompt"] != item.prompt:
                    raise _bad_record(out, line_no, f"record {rid} does not match input line {rid}",
                                      {"prompt": rec["prompt"], "input_sha256": rec["input_sha256"]})
            if step is not None and rec["step"] != step:
                raise _bad_record(out, line_no, f"record {rid} was made at another step", rec["step"],
                                  hint=f"this ledger is bound to step {step}")
            lines[rid] = line_no
            records[rid] = rec
    return LedgerScan(records, complete_size, len(data) - complete_size)


def _scan_fd(fd: int, path: Path, on_line: Callable[[int, bytes], None]) -> tuple[int, int]:
    """Stream the ledger's complete lines to ``on_line(line_no, line)``; return ``(complete_size, size)``.

    Read in 1 MiB chunks and never held whole: only the current line is in memory, and a line
    longer than :data:`_RECORD_MAX` stops the read with an IntegrityError. Bounding each line
    does not bound their sum (docs/FAULTS.md, "Many pieces, one budget"): a sparse 100 GB file
    cut into lines under the bound would be read whole. The sum is bounded by the caller, which
    stops at the first line that is not a record and keeps at most one id per input item.
    """
    buf = bytearray()
    offset = 0  # bytes read so far
    line_no = 0
    complete = 0  # bytes up to and including the last newline seen
    searched = 0  # how much of buf is known to hold no newline
    while True:
        try:
            chunk = os.pread(fd, 1 << 20, offset)
        except OSError as exc:
            raise BadInput("ledger could not be read", file=path, found=_describe_oserror(exc),
                           hint="check the disk and the file's permissions") from exc
        if not chunk:
            return complete, offset
        offset += len(chunk)
        buf.extend(chunk)
        start = 0
        nl = buf.find(b"\n", searched)
        while nl >= 0:
            line_no += 1
            on_line(line_no, bytes(buf[start:nl]))
            start = nl + 1
            nl = buf.find(b"\n", start)
        if start:
            complete = offset - (len(buf) - start)
            del buf[:start]
        searched = len(buf)
        if len(buf) > _RECORD_MAX:
            raise _bad_record(path, line_no + 1, "line too long for a record",
                              f"more than {_RECORD_MAX} bytes from offset {complete}")


def _parse_record(line: bytes, line_no: int, out: Path) -> dict[str, Any]:
    """One complete ledger line as a record (its keys and id checked), or the typed error."""
    try:
        rec = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: deep nesting
        raise _bad_record(out, line_no, "not a JSON object", repr(line[:120])) from None
    if not isinstance(rec, dict) or set(rec) != set(RECORD_KEYS):
        found = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
        raise _bad_record(out, line_no, "not a ledger record", found)
    rid = rec["id"]
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise _bad_record(out, line_no, "id is not an integer", repr(rid))
    if not isinstance(rec["completion"], str):
        raise _bad_record(out, line_no, "completion is not a string", type(rec["completion"]).__name__)
    return rec


@dataclass
class _Seen:
    """What the streamed scan keeps of one record: its line and two verdicts, never its text."""

    line: int
    matches_input: bool
    step: Any  # the record's step when it is not the job's (for the message), else None


def _scan_ledger_fd(fd: int, out: Path, items: Sequence[InputItem],
                    step: int) -> tuple[dict[int, _Seen], int, int]:
    """The ledger streamed (:func:`_scan_fd`): at most one entry per input item is kept (an id out
    of range or seen twice stops the scan), so memory is bounded by the inputs, never by the
    ledger's size. Returns ``(seen, complete_size, size)``."""
    seen: dict[int, _Seen] = {}

    def on_line(line_no: int, line: bytes) -> None:
        rec = _parse_record(line, line_no, out)
        rid = rec["id"]
        if rid in seen:
            raise _duplicate(out, rid, seen[rid].line, line_no)
        if not 1 <= rid <= len(items):
            raise _bad_record(out, line_no, "id out of range", rid, hint=f"the inputs have {len(items)} lines")
        item = items[rid - 1]
        ok = rec["input_sha256"] == item.sha256 and rec["prompt"] == item.prompt
        other = None if rec["step"] == step else rec["step"]
        if isinstance(other, str | bytes | list | dict):
            other = repr(other)[:80]
        seen[rid] = _Seen(line_no, ok, other)

    complete, size = _scan_fd(fd, out, on_line)
    return seen, complete, size


def _check_seen(seen: dict[int, _Seen], out: Path, step: int) -> None:
    """The checks against the job, after its binding was compared (a ledger of another job is
    named as such first): each record's input and step, in line order."""
    for rid, s in seen.items():
        if not s.matches_input:
            raise _bad_record(out, s.line, f"record {rid} does not match input line {rid}",
                              "another prompt or input_sha256")
        if s.step is not None:
            raise _bad_record(out, s.line, f"record {rid} was made at another step", s.step,
                              hint=f"this ledger is bound to step {step}")


def _duplicate(out: Path, rid: int, first: int, line_no: int) -> IntegrityError:
    return _bad_record(
        out, line_no, f"duplicate id {rid}: the item was recorded twice",
        f"id {rid} on line {first} and on line {line_no}",
        hint="two writers shared this ledger, or it was edited; its outputs cannot be trusted "
        "as exactly-once — keep it for inspection and write to a new --out file",
    )


class _LedgerFile:
    """The open, locked ledger: append one record per item with one write, then fsync."""

    def __init__(self, out: Path) -> None:
        self.path = out
        existed = os.path.lexists(out)
        # no link followed, no FIFO waited on, a regular file or a typed error (docs/FAULTS.md)
        fd = open_run_file(out, "the output ledger (--out)", mode="create_append")
        try:
            st = os.fstat(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    raise LockHeld(
                        "the output ledger is being written by another process",
                        file=out, expected="one writer per ledger",
                        found="an exclusive lock held by another process",
                        hint=f"wait for that job to finish (find it with `fuser {out}`), or write to "
                        "another --out file",
                    ) from exc
                raise BadInput("the operating system refused to lock the ledger", file=out,
                               expected="a filesystem that supports flock", found=_describe_oserror(exc)) from exc
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        self.created = not existed
        self.size = st.st_size

    def scan(self, items: Sequence[InputItem], step: int) -> tuple[dict[int, _Seen], int, int]:
        assert self.fd is not None
        return _scan_ledger_fd(self.fd, self.path, items, step)

    def truncate(self, size: int) -> None:
        """Cut the torn tail (the only rewrite): back to ``size`` bytes, then fsync."""
        assert self.fd is not None
        try:
            os.ftruncate(self.fd, size)
            ops.fsync(self.fd, self.path)
        except OSError as exc:
            raise SaveFailed("could not remove the ledger's torn last line", file=self.path,
                             expected="a writable ledger", found=_describe_oserror(exc),
                             hint="the completed records before it are untouched") from exc
        self.size = size

    def append(self, line: bytes) -> None:
        """Append one complete record and fsync it; on failure remove it again and raise."""
        assert self.fd is not None and line.endswith(b"\n")
        start = self.size
        view = memoryview(line)
        done = 0
        try:
            while done < len(view):  # one write; the loop only finishes a short write
                done += ops.write(self.fd, view[done:], self.path)
            ops.fsync(self.fd, self.path)
        except OSError as exc:
            try:  # a record whose durability is unknown must not count as done
                os.ftruncate(self.fd, start)
            except OSError:
                pass
            raise SaveFailed(
                "could not record a completed item in the ledger", file=self.path,
                expected="a durable append (write + fsync)", found=_describe_oserror(exc),
                hint=("the disk is full; free space and run the same command again"
                      if exc.errno == errno.ENOSPC else "check the disk, then run the same command again")
                + " — completed items are kept and skipped",
            ) from exc
        self.size = start + len(line)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the description drops the flock
            self.fd = None


def _clean_meta_temporaries(meta: Path) -> None:
    """Remove leftover temporary meta files of killed writers (ours only, dead pids only)."""
    prefix = f".{meta.name}.tmp."
    try:
        entries = list(os.scandir(meta.parent))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(prefix) or not is_temp_name(entry.name):
            continue
        pid = temp_name_pid(entry.name)  # bounded digits: never an OverflowError
        if pid is None:
            continue
        if pid != os.getpid() and pid_alive(pid):
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            pass


def _read_meta(meta: Path) -> dict[str, Any] | None:
    if not os.path.lexists(meta):
        return None
    raw = read_small(meta, "ledger meta file", _META_MAX, error=IntegrityError)  # no link, no FIFO, bounded
    doc = parse_json_bytes(raw, meta, "ledger meta file", error=IntegrityError)
    if (not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("binding"), dict)):
        raise IntegrityError("not a ripresa ledger meta file", file=meta,
                             expected=f'{{"format": "{FORMAT}", "binding": {{...}}, ...}}',
                             found=repr(raw[:120]))
    if doc.get("format_version") != FORMAT_VERSION:
        raise IntegrityError("unsupported ledger meta format version", file=meta,
                             expected=FORMAT_VERSION, found=doc.get("format_version"),
                             hint="continue this ledger with the ripresa version that started it")
    return doc


def _binding_differences(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    diffs = []
    for key in sorted(set(saved) | set(wanted)):
        if key == "generation" and isinstance(saved.get(key), dict) and isinstance(wanted.get(key), dict):
            for sub in sorted(set(saved[key]) | set(wanted[key])):
                if saved[key].get(sub) != wanted[key].get(sub):
                    diffs.append(f"{sub}: ledger {saved[key].get(sub)!r}, now {wanted[key].get(sub)!r}")
        elif saved.get(key) != wanted.get(key):
            a, b = saved.get(key), wanted.get(key)
            if key.endswith("sha256") and isinstance(a, str) and isinstance(b, str):
                a, b = a[:12] + "…", b[:12] + "…"
            diffs.append(f"{key}: ledger {a!r}, now {b!r}")
    return diffs


# ---- the model ------------------------------------------------------------------------


@dataclass
class _Loaded:
    model: Any
    step: int
    bin_name: str
    bin_sha256: str
    model_config: dict[str, Any]


def _read_run_config(run: Path) -> dict[str, Any]:
    path = run / "config.json"
    cfg = read_json_small(path, "the run's config.json", _META_MAX)  # no link, no FIFO, bounded
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise BadInput("the run's config.json has no model section", file=path,
                       expected='{"model": {"n_layer": ..., ...}, ...}',
                       found=sorted(cfg) if isinstance(cfg, dict) else type(cfg).__name__,
                       hint="generate needs a run folder made by `ripresa train`")
    return cfg


def _load_generation(run: Path, step: int | None, device: str) -> _Loaded:
    """Build the GPT from ``RUN/config.json`` and load generation ``step`` (or the latest valid) into it."""
    import torch

    from ..store.store import CheckpointStore, CheckpointWarning, not_used
    from .gpt.model import GPT, from_config_dict

    if not run.is_dir():
        raise BadInput("run folder not found", file=run, expected="a run folder made by `ripresa train`",
                       found="nothing" if not run.exists() else "not a folder")
    cfg = _read_run_config(run)
    mconf = from_config_dict(cfg["model"])
    # The parameter count is computed from the config (nothing allocated); the model is built only
    # after a generation of exactly that many parameters has loaded, so a hostile config.json
    # cannot make generate allocate more than the checkpoint's own size.
    n = mconf.param_count()
    store = CheckpointStore(run, writer=False)
    on_disk = store.steps_on_disk()
    if step is not None:
        if step not in on_disk:
            raise BadInput(f"generation {step} not found in the run folder", file=run,
                           expected=f"one of the steps on disk: {on_disk or 'none'}", found=f"--step {step}",
                           hint="`ripresa inspect RUN` lists the valid generations")
        candidates = [step]
    else:
        candidates = list(reversed(on_disk))
    chosen = None
    for s in candidates:
        g = store.check(s, deep=False)
        try:
            if not g.valid:
                raise IntegrityError(f"generation {s} is not valid: {g.reason}", file=g.bin,
                                     hint="choose another --step; `ripresa inspect RUN` lists the valid ones")
            contents, companion = store.load(s, expected_n=n)  # hashes the .bin while reading it
        except IntegrityError as exc:
            if step is not None:
                raise
            warnings.warn(not_used("generation", s, exc.message, exc.file, then="an older one is tried"), CheckpointWarning,
                          stacklevel=3)
            continue
        chosen = (g, contents, companion)
        break
    if chosen is None:
        raise BadInput("no valid generation in the run folder", file=run, expected="a committed, verified generation",
                       found=f"steps on disk: {on_disk or 'none'}", hint="train the run first")
    g, contents, companion = chosen
    model = GPT(mconf)
    if model.n_params() != n:  # pragma: no cover - param_count() is GPT's own arithmetic
        raise IntegrityError("the model's parameter count differs from its config's", file=run / "config.json",
                             expected=n, found=model.n_params())
    saved_model = ((companion.get("config") or {}).get("model")) if isinstance(companion, dict) else None
    if isinstance(saved_model, dict):
        shape = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")
        if any(saved_model.get(k) != cfg["model"].get(k) for k in shape):
            raise BadInput("config.json's model differs from the one generation was trained with",
                           file=run / "config.json", expected={k: saved_model.get(k) for k in shape},
                           found={k: cfg["model"].get(k) for k in shape},
                           hint="restore the run's config.json")
    flat = torch.from_numpy(contents.weights)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(flat, model.parameters())  # copies: .bin order = parameters() order
    buffers = dict(model.named_buffers())
    if buffers:  # GPT has none today; a model with buffers takes them from the companion
        saved = companion.get("model", {})
        missing = sorted(set(buffers) - set(saved))
        if missing:
            raise IntegrityError("the companion lacks the model's buffers", file=g.companion, found=missing)
        model.load_state_dict({**model.state_dict(), **{k: saved[k] for k in buffers}}, strict=True)
    model.to(device)
    model.eval()
    assert g.bin_sha256 is not None
    return _Loaded(model, g.step, g.bin.name, g.bin_sha256, dict(cfg["model"]))


def _complete(model: Any, item: InputItem, step: int, max_new_tokens: int, temperature: float,
              top_k: int | None, device: str) -> str:
    import torch

    prompt = item.prompt.encode("utf-8") or b"\n"  # an empty line is completed from a newline
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    gen = torch.Generator(device="cpu").manual_seed(item_seed(step, item.id))
    y = model.generate(idx, max_new_tokens, generator=gen, temperature=temperature, top_k=top_k)
    return bytes(y[0, idx.size(1):].tolist()).decode("utf-8", "replace")


def _record_line(item: InputItem, completion: str, step: int) -> bytes:
    rec = {"id": item.id, "input_sha256": item.sha256, "prompt": item.prompt,
           "completion": completion, "step": step}
    return json.dumps(rec, ensure_ascii=False).encode("utf-8") + b"\n"


# ---- the job -----------------------------------------------------------------------------


def _validate_settings(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise BadInput("max_new_tokens must be a positive integer", expected=">= 1", found=repr(max_new_tokens))
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not temperature >= 0:
        raise BadInput("temperature must be >= 0", expected=">= 0 (0 = greedy)", found=repr(temperature))
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise BadInput("top_k must be >= 1 or None", expected=">= 1, or None for no cut", found=repr(top_k))


def generate_batch(
    run: Path,
    inputs: Path,
    out: Path,
    *,
    step: int | None = None,
    max_new_tokens: int = 32,
    temperature: float = 0.8,
    top_k: int | None = 40,
    show_progress: bool = True,
    device: str = "cpu",
    on_start: Callable[[dict[str, Any]], None] | None = None,
    on_item: ItemHook | None = None,
) -> dict[str, Any]:
    """Complete every input not yet in the ledger ``out``; safe to kill and rerun at any moment.

    Args:
        run: a run folder made by ``ripresa train`` (``config.json`` + generations).
        inputs: one prompt per line, UTF-8; an input's id is its line number.
        out: the JSONL ledger (created if missing, continued if it exists); its
            binding lives in ``out.meta.json``.
        step: the generation to use; ``None`` = the newest valid one (a damaged
            newer one is skipped with a warning). The ``.bin`` is hash-verified.
        max_new_tokens, temperature, top_k: sampling settings (``temperature``
            0 = greedy; ``top_k`` None = no cut). Part of the binding.
        show_progress: a rich progress bar on stderr (completed / total).
        device: where the model runs (``"cpu"``, ``"cuda"``); sampling draws
            from a CPU generator either way. Not part of the binding.
        on_start: called once with ``{total, already_done, to_do, step,
            repaired_bytes}`` when the ledger is locked and read.
        on_item: called as ``on_item("generated", id)`` after an item's text is
            generated and before it is recorded, and ``on_item("recorded", id)``
            once its record is durable (for logs, metrics and tests).

    Returns:
        ``{"total", "already_done", "generated_now", "out", "meta", "step",
        "bin_sha256", "repaired_bytes"}``.

    Raises:
        BadInput (exit 2): unreadable inputs or run, a ledger bound to another
            job (step, weights, inputs, settings), a ledger held by another
            writer (:class:`~ripresa.errors.LockHeld`).
        IntegrityError (exit 1): a damaged generation asked for by ``step``, a
            ledger with a duplicate id or a record that is not one.
        SaveFailed (exit 2): a record could not be written durably.
    """
    run, inputs, out = Path(run), Path(inputs), Path(out)
    _validate_settings(max_new_tokens, temperature, top_k)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise BadInput("step must be a non-negative integer", expected=">= 0", found=repr(step))
    items, inputs_sha = read_inputs(inputs)
    if os.path.lexists(out) and os.path.exists(out) and os.path.samefile(out, inputs):
        raise BadInput("--out is the inputs file", file=out, expected="a separate ledger file",
                       found="the same file as --inputs")
    if not out.parent.is_dir():
        raise BadInput("the ledger's folder does not exist", file=out.parent, expected="an existing folder",
                       found="nothing" if not out.parent.exists() else "not a folder")

    loaded = _load_generation(run, step, device)
    binding = {
        "step": loaded.step,
        "bin": loaded.bin_name,
        "bin_sha256": loaded.bin_sha256,
        "model": loaded.model_config,
        "inputs_sha256": inputs_sha,
        "n_inputs": len(items),
        "generation": {"max_new_tokens": max_new_tokens, "temperature": float(temperature), "top_k": top_k,
                       "seed_rule": SEED_RULE},
    }
    meta = meta_path(out)
    ledger = _LedgerFile(out)
    try:
        saved = _read_meta(meta)
        seen, complete_size, size = ledger.scan(items, loaded.step)
        ledger.size = size
        if saved is not None:
            diffs = _binding_differences(saved["binding"], binding)
            if diffs and complete_size:  # a meta with no complete record binds nothing
                gen_was = saved["binding"].get("generation", {}) if isinstance(saved["binding"], dict) else {}
                hint = ("write to a new --out file, or continue this one with its own settings: "
                        f"--step {saved['binding'].get('step')} "
                        f"--max-new-tokens {gen_was.get('max_new_tokens')} "
                        f"--temperature {gen_was.get('temperature')} --top-k {gen_was.get('top_k')}"
                        " and the same inputs file")
                if step is None and saved["binding"].get("step") != loaded.step:
                    hint = (f"the ledger was made from step {saved['binding'].get('step')} and the newest valid "
                            f"generation is now {loaded.step}: pass --step {saved['binding'].get('step')} to "
                            "continue it, or write to a new --out file")
                raise BadInput("the ledger was started by another job; refusing to mix outputs",
                               file=meta, expected="the same step, weights, inputs and generation settings",
                               found="; ".join(diffs), hint=hint)
            if diffs:
                saved = None  # nothing recorded under the old binding: rebind
        elif complete_size:
            raise BadInput("the ledger has records but no meta file", file=meta,
                           expected=f"{meta.name} beside {out.name}", found="nothing",
                           hint="without it the job that made these records cannot be known; write to a new "
                           "--out file")
        _check_seen(seen, out, loaded.step)
        repaired = 0
        if size > complete_size:
            repaired = size - complete_size
            ledger.truncate(complete_size)
        if saved is None:
            _clean_meta_temporaries(meta)
            doc = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "ledger": out.name,
                "binding": binding,
                "run": str(run.resolve()),
                "inputs": str(inputs.resolve()),
                "produced_by": _produced_by(device),
                "created": time.time(),
            }
            # write_atomic fsyncs the folder after its rename: that also makes a
            # just-created ledger's own name durable
            write_atomic(meta, [json.dumps(doc, indent=1, ensure_ascii=False).encode("utf-8") + b"\n"])
        elif ledger.created:
            fsync_dir(out.parent)  # the ledger (deleted and re-created) must keep its name after a power cut

        done = set(seen)
        todo = [it for it in items if it.id not in done]
        start_info = {"total": len(items), "already_done": len(done), "to_do": len(todo),
                      "step": loaded.step, "repaired_bytes": repaired}
        if on_start is not None:
            on_start(start_info)
        generated = 0
        resumed = f" (resumed: {len(done)} already done)" if done else ""
        with _progress(show_progress) as bar:
            task = bar.add_task(f"generate step {loaded.step}{resumed}", total=len(items), completed=len(done),
                                unit="prompts")
            for item in todo:
                text = _complete(loaded.model, item, loaded.step, max_new_tokens, float(temperature), top_k, device)
                if on_item is not None:
                    on_item("generated", item.id)
                ledger.append(_record_line(item, text, loaded.step))
                generated += 1
                if on_item is not None:
                    on_item("recorded", item.id)
                bar.advance(task)
    finally:
        ledger.close()
    return {
        "total": len(items),
        "already_done": len(done),
        "generated_now": generated,
        "out": str(out),
        "meta": str(meta),
        "step": loaded.step,
        "bin_sha256": loaded.bin_sha256,
        "repaired_bytes": repaired,
    }


def _produced_by(device: str) -> dict[str, Any]:
    import torch

    from .._version import __version__

    return {"ripresa": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "device": device, "threads": torch.get_num_threads()}


def _progress(show: bool) -> Any:
    """The batch's progress line (ripresa.console.progress: on stderr, a TTY only, not under --quiet)."""
    from ..console import progress

    return progress(quiet=not show, transient=False)


# ---- `python -m ripresa.engine.ledger` (the CLI's `ripresa generate`, and the tests' child) -----


def _top_k(text: str) -> int | None:
    if text.lower() in ("none", "0", "off"):
        return None
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``ripresa generate`` (and ``python -m ripresa.engine.ledger``)."""
    p = argparse.ArgumentParser(prog="ripresa generate",
                                description="Complete a file of prompts, one per line, into a crash-safe JSONL ledger.")
    p.add_argument("run", type=Path, help="a run folder made by ripresa train (config.json + generations)")
    p.add_argument("--inputs", type=Path, required=True, metavar="FILE",
                   help="the prompts, one per line (UTF-8); the line number is the item's id")
    p.add_argument("--out", type=Path, required=True, metavar="OUT.jsonl",
                   help="the ledger: one line per completed item, appended and fsync'd; run the same command again "
                        "after a kill and it continues (OUT.meta.json beside it binds it to the step and the inputs)")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="the generation whose weights complete the prompts (default: the newest valid one; hash-verified)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="bytes generated per prompt (default 32)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    p.add_argument("--top-k", type=_top_k, default=40, help="sample among the k likeliest bytes: an integer, or none")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    # testing knobs: slow each item down, and log each generation (before it is recorded)
    p.add_argument("--sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--trace", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ripresa.engine.ledger RUN --inputs FILE --out OUT.jsonl [--step N] ...``; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    trace = open(args.trace, "a", buffering=1) if args.trace else None

    def on_start(info: dict[str, Any]) -> None:
        print(f"ripresa generate: {info['already_done']}/{info['total']} already done at step {info['step']}, "
              f"{info['to_do']} to go" + (f" (removed a torn last line, {info['repaired_bytes']} bytes)"
                                          if info["repaired_bytes"] else ""), file=sys.stderr, flush=True)

    def on_item(stage: str, item_id: int) -> None:
        if stage == "generated" and trace is not None:
            trace.write(f"{os.getpid()} {item_id}\n")
        if args.sleep:
            time.sleep(args.sleep / 2)

    try:
        report = generate_batch(args.run, args.inputs, args.out, step=args.step, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_k=args.top_k, show_progress=not args.quiet,
                                device=args.device, on_start=on_start, on_item=on_item)
    except RipresaError as exc:
        print(f"ripresa generate: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ripresa generate: interrupted (completed items are recorded; run again to continue)", file=sys.stderr)
        return 2
    finally:
        if trace is not None:
            trace.close()
    from ..console import fit_json

    print(fit_json(report))  # one key a line, 80 columns: the hash and paths whole, never split
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
