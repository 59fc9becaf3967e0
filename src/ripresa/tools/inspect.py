"""``ripresa inspect PATH``: what a checkpoint holds, and whether it can be trusted.

PATH is an ANDREA ``.bin``, a ``.safetensors`` file (a general generation's, or
a foreign one: :mod:`ripresa.tools.inspect_general`), a ``checkpoint.pt`` or a run folder; inspection is
read-only (nothing written, locked or deleted). What is checked, the exit
codes and the stable keys of the ``--json`` document: docs/INSPECT.md.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import stat
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadInput, IntegrityError, RipresaError
from ..io.fsio import open_regular, temp_name_pid
from ..io.lock import pid_alive

SCHEMA = "ripresa.tools.inspect"
SCHEMA_VERSION = 1

#: Floats per streaming block of the statistics pass (4 MiB of float32; the
#: float64 temporaries of one block are 8 MiB each).
STAT_BLOCK = 1 << 20


# ---- statistics --------------------------------------------------------------------


class Stats:
    """Streaming float64 statistics of one array, fed block by block.

    Non-finite values are counted (NaN, +Inf, -Inf, the first one located)
    and left out of ``min``/``max``/``mean``/``std``; mean and variance are
    merged over blocks with Chan et al.'s pairwise formula.
    """

    def __init__(self) -> None:
        self.count = 0
        self.finite = 0
        self.nan = 0
        self.posinf = 0
        self.neginf = 0
        self.first_nonfinite: dict[str, Any] | None = None
        self.min = math.inf
        self.max = -math.inf
        self.mean = 0.0
        self.m2 = 0.0

    def add(self, block: np.ndarray, *, where: str, index: int = 0, offset: int | None = None, itemsize: int = 4) -> None:
        """Fold a 1-D block in. ``index`` is the block's first element index
        within ``where``; ``offset`` its byte offset in the file (or ``None``)."""
        a = block.reshape(-1)
        n = int(a.size)
        if n == 0:
            return
        self.count += n
        x = a.astype(np.float64)  # always a copy: the in-place steps below never touch the caller's data
        with np.errstate(invalid="ignore", over="ignore"):  # inf + -inf in a damaged block
            total_sum = float(x.sum())
        if not math.isfinite(total_sum):  # a NaN/Inf somewhere (or a float64 overflow): count and drop them
            fin = np.isfinite(x)
            nan = int(np.count_nonzero(np.isnan(x)))
            pos = int(np.count_nonzero(x == np.inf))
            self.nan += nan
            self.posinf += pos
            self.neginf += n - int(np.count_nonzero(fin)) - nan - pos
            if self.first_nonfinite is None and not fin.all():
                i = int(np.argmin(fin))
                self.first_nonfinite = {
                    "where": where,
                    "index": index + i,
                    "offset": None if offset is None else offset + itemsize * i,
                    "value": repr(float(a[i])),
                }
            x = x[fin]
            if x.size == 0:
                return
            total_sum = float(x.sum())
        k = int(x.size)
        bmin, bmax = float(x.min()), float(x.max())
        bmean = total_sum / k
        np.subtract(x, bmean, out=x)
        np.square(x, out=x)
        bm2 = float(x.sum())
        self.min = min(self.min, bmin)
        self.max = max(self.max, bmax)
        merged = self.finite + k
        delta = bmean - self.mean
        self.mean += delta * k / merged
        self.m2 += bm2 + delta * delta * self.finite * k / merged
        self.finite = merged

    @property
    def nonfinite(self) -> int:
        return self.count - self.finite

    def as_dict(self) -> dict[str, Any]:
        has = self.finite > 0
        return {
            "count": self.count,
            "finite": self.finite,
            "nan": self.nan,
            "posinf": self.posinf,
            "neginf": self.neginf,
            "min": self.min if has else None,
            "max": self.max if has else None,
            "mean": self.mean if has else None,
            "std": math.sqrt(self.m2 / self.finite) if has else None,
            "first_nonfinite": self.first_nonfinite,
        }


def _tensor_blocks(t: Any) -> Iterable[tuple[int, np.ndarray]]:
    """``(start, float64-able numpy block)`` of a tensor, flattened, in blocks."""
    import torch

    flat = t.detach().reshape(-1)
    for start in range(0, flat.numel(), STAT_BLOCK):
        piece = flat[start : start + STAT_BLOCK]
        if piece.device.type != "cpu":
            piece = piece.cpu()
        if piece.dtype not in (torch.float32, torch.float64):
            piece = piece.to(torch.float64)  # bfloat16/float16 have no numpy view
        yield start, piece.numpy()


def _add_tensor(stats: Stats, t: Any, where: str) -> None:
    for start, block in _tensor_blocks(t):
        stats.add(block, where=where, index=start)


# ---- small helpers -----------------------------------------------------------------


def _jsonable(obj: Any) -> Any:
    """A JSON-safe copy: tensors summarised, tuples as lists, non-finite floats as strings."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return _jsonable(obj.item())
        return {"tensor": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape)}
    if isinstance(obj, np.ndarray):
        return {"tensor": str(obj.dtype), "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, bytes | bytearray):
        return f"<{len(obj)} bytes>"
    if isinstance(obj, Path):
        return str(obj)
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    return repr(obj)


def _err_text(exc: RipresaError) -> str:
    """One line: message, file, and what was found."""
    text = exc.message
    if exc.file:
        text += f" ({exc.file})"
    if exc.expected is not None:
        text += f"; expected {exc.expected}"
    if exc.found is not None:
        text += f"; found {exc.found}"
    return text


class _Verdict:
    """Problems (each with its exit code) and warnings of one inspection."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.notes: list[str] = []
        self.code = 0

    def fail(self, text: str, code: int = 1) -> None:
        self.problems.append(text)
        self.code = max(self.code, code)

    def warn(self, text: str) -> None:
        self.warnings.append(text)


def _base(path: str | Path, kind: str | None, check_finite: bool, deep: bool) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "path": str(path),
        "kind": kind,
        "ok": True,
        "exit_code": 0,
        "problems": [],
        "warnings": [],
        "notes": [],
        "options": {"check_finite": check_finite, "deep": deep},
        "error": None,
        "bin": None,
        "checkpoint": None,
        "run": None,
        "safetensors": None,
        "dcp": None,
    }


def _finish(report: dict[str, Any], verdict: _Verdict) -> dict[str, Any]:
    report["problems"] = verdict.problems
    report["warnings"] = verdict.warnings
    report["notes"] = verdict.notes
    report["exit_code"] = verdict.code
    report["ok"] = verdict.code == 0
    return _jsonable(report)


def error_report(path: str | Path, exc: RipresaError, *, check_finite: bool = False, deep: bool = True) -> dict[str, Any]:
    """The JSON document for an inspection that could not start (missing path, unknown kind)."""
    report = _base(path, None, check_finite, deep)
    report["error"] = exc.as_dict()
    v = _Verdict()
    v.fail(_err_text(exc), exc.exit_code)
    return _finish(report, v)


# ---- entry point -------------------------------------------------------------------


def inspect_path(path: str | Path, *, check_finite: bool = False, deep: bool = True) -> dict[str, Any]:
    """Inspect a ``.bin``, a ``checkpoint.pt`` or a run folder; return the report.

    The report is JSON-able (see the module docstring for its keys) and
    carries its ``exit_code``. Raises :class:`~ripresa.errors.BadInput`
    (exit 2) for a missing or special path and a file of no known kind.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise BadInput(
            "nothing to inspect: the path does not exist",
            file=p,
            expected="a .bin, a checkpoint.pt or a run folder",
            found="nothing at this path" if not os.path.lexists(p) else "a dangling symlink",
            hint="check the path",
        ) from None
    except OSError as exc:
        raise BadInput("cannot inspect the path", file=p, expected="a readable path", found=str(exc)) from exc
    try:
        return _dispatch(p, path, st, check_finite=check_finite, deep=deep)
    except OSError as exc:  # an unreadable folder entry, an I/O error
        raise BadInput(
            "inspection could not be completed",
            file=getattr(exc, "filename", None) or p,
            expected="readable files",
            found=f"{type(exc).__name__}: {exc}",
            hint="check the permissions and the disk",
        ) from exc


def _dispatch(p: Path, path: str | Path, st: os.stat_result, *, check_finite: bool, deep: bool) -> dict[str, Any]:
    if stat.S_ISDIR(st.st_mode) and p.name.endswith(".dcp"):  # one sharded generation (tools/inspect_dcp.py)
        return _inspect_dcp(p, path, check_finite=check_finite, deep=deep)
    if stat.S_ISDIR(st.st_mode):
        return _inspect_folder(p, path, check_finite=check_finite, deep=deep)
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(
            "cannot inspect a special file",
            file=p,
            expected="a .bin, a checkpoint.pt or a run folder",
            found="a FIFO, socket or device",
            hint="ripresa never reads from special files",
        )
    kind = _file_kind(p)
    if kind == "bin":
        return _inspect_bin(p, path, check_finite=check_finite, deep=deep)
    if kind == "checkpoint.pt":
        return _inspect_pt(p, path, check_finite=check_finite, deep=deep)
    if kind == "safetensors":
        from .inspect_general import inspect_safetensors

        return inspect_safetensors(p, path, check_finite=check_finite, deep=deep)
    raise BadInput(
        "unknown kind of file",
        file=p,
        expected="an ANDREA .bin, a .safetensors file, a checkpoint.pt (torch zip archive) or a run folder",
        found=f"a file named '{p.name}'",
        hint="for a generation's .json or .sha256, inspect its .bin or the run folder",
    )


def _inspect_dcp(p: Path, given: str | Path, *, check_finite: bool, deep: bool) -> dict[str, Any]:
    from .inspect_dcp import inspect_dcp

    report = _base(given, "dcp", check_finite, deep)
    v = _Verdict()
    report["dcp"], problems, warns = inspect_dcp(p, given, deep=deep)
    for text, code in problems:
        v.fail(text, code)
    for text in warns:
        v.warn(text)
    if check_finite:
        v.warn("--check-finite is not applied to .dcp shards (the tensors are not read); export or convert first")
    return _finish(report, v)


def _file_kind(p: Path) -> str | None:
    if p.suffix == ".bin":
        return "bin"
    if p.suffix == ".safetensors":
        return "safetensors"
    if p.suffix in (".pt", ".pth"):
        return "checkpoint.pt"
    try:
        fd = open_regular(p, "file")  # the descriptor is checked: a FIFO is refused, never waited on
    except RipresaError:
        return None
    try:
        if os.pread(fd, 4, 0) == b"PK\x03\x04":  # a zip archive: what torch.save writes
            return "checkpoint.pt"
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


# ---- ANDREA .bin -------------------------------------------------------------------


def _raw_header(p: Path) -> tuple[int, int | None, int | None]:
    """(size, step, n_params) read without validation, for reporting a damaged file."""
    from ..formats.andrea_bin import HEADER, HEADER_SIZE
    from ..io.fsio import open_regular

    fd = open_regular(p, "ANDREA .bin")
    try:
        size = os.fstat(fd).st_size
        raw = os.pread(fd, HEADER_SIZE, 0)
    finally:
        os.close(fd)
    if len(raw) < HEADER_SIZE:
        return size, None, None
    step, n = HEADER.unpack(raw)
    return size, step, n


def scan_bin(p: Path, step: int, n_params: int) -> tuple[str, dict[str, Stats]]:
    """One streaming pass over a validated ``.bin``: its sha256 and per-region statistics.

    Two reused buffers of :data:`STAT_BLOCK` floats; each block is hashed in
    a helper thread while its statistics are computed and the next block is
    read. Raises :class:`~ripresa.errors.IntegrityError` if the file changed
    size while it was read.
    """
    from ..formats.andrea_bin import FLOAT, HEADER_SIZE, REGIONS, refuse_growth
    from ..io.fsio import open_regular, read_exact_hashing

    expected_size = HEADER_SIZE + 12 * n_params
    fd = open_regular(p, "ANDREA .bin")
    stats = {name: Stats() for name in REGIONS}
    try:
        size = os.fstat(fd).st_size
        if size != expected_size:
            raise IntegrityError(
                "ANDREA .bin changed size while it was inspected",
                file=p,
                expected=f"{expected_size} bytes",
                found=f"{size} bytes",
                hint="another process is writing this file; inspect a committed generation",
            )
        if hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_SEQUENTIAL"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass
        hasher = hashlib.sha256()
        header = bytearray(HEADER_SIZE)
        read_exact_hashing(fd, [header], hasher, path=p, what="ANDREA .bin")
        block = min(STAT_BLOCK, n_params)
        bufs = [np.empty(block, dtype=FLOAT), np.empty(block, dtype=FLOAT)]
        pending: Future[None] | None = None
        i = 0
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ripresa-inspect-hash") as pool:
            try:
                for r, name in enumerate(REGIONS):
                    region_offset = HEADER_SIZE + 4 * n_params * r
                    for start in range(0, n_params, block):
                        k = min(block, n_params - start)
                        arr = bufs[i % 2][:k]
                        i += 1
                        raw = memoryview(arr.view(np.uint8))
                        read_exact_hashing(fd, [raw], None, path=p, what="ANDREA .bin")
                        if pending is not None:
                            pending.result()  # hash in file order; frees the other buffer
                        pending = pool.submit(hasher.update, raw)
                        stats[name].add(arr, where=name, index=start, offset=region_offset + 4 * start)
            finally:
                if pending is not None:
                    pending.result()
        refuse_growth(fd, p, expected_size, done="inspected", do="inspect")
    finally:
        os.close(fd)
    return hasher.hexdigest(), stats


def _regular(p: Path) -> bool:
    return p.is_file() and not p.is_symlink()


def _line_count(p: Path) -> int:
    """Lines of a small regular file (0 if it is not one); never follows links or blocks."""
    if not _regular(p):
        return 0
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return 0
    try:
        raw = os.read(fd, 4097)
    finally:
        os.close(fd)
    return len(raw.splitlines())


def _bin_sidecar(p: Path, companion: Path) -> dict[str, Any]:
    from ..io.fsio import read_sidecar, sidecar_path
    from ..store.store import read_marker

    side = sidecar_path(p)
    info: dict[str, Any] = {"path": str(side), "present": os.path.lexists(side), "kind": None, "error": None, "lines": []}
    if not info["present"]:
        return info
    try:
        if _line_count(side) == 2:
            bin_hex, comp_hex = read_marker(side, p, companion)
            info["kind"] = "generation-marker"
            info["lines"] = [
                {"name": p.name, "expected": bin_hex, "actual": None, "ok": None},
                {"name": companion.name, "expected": comp_hex, "actual": None, "ok": None},
            ]
        else:
            info["kind"] = "sha256sum"
            info["lines"] = [{"name": p.name, "expected": read_sidecar(p), "actual": None, "ok": None}]
    except RipresaError as exc:
        info["error"] = _err_text(exc)
        info["error_exit_code"] = exc.exit_code
    return info


def _state_summary(encoded: Any) -> dict[str, Any]:
    """progress / versions / code / data identity of a companion's (encoded) state."""
    from ..formats.companion import decode_tree

    out: dict[str, Any] = {"state_keys": [], "progress": None, "versions": None, "code": None, "data_identity": None}
    if not isinstance(encoded, dict):
        return out
    out["state_keys"] = sorted(map(str, encoded))
    for key in ("progress", "versions", "data_identity"):
        if key in encoded:
            try:
                decoded = decode_tree(encoded[key])
            except RipresaError:
                decoded = None
            # renderers iterate these as dicts; JSON output needs finite floats and no tensors
            out[key] = _jsonable(decoded) if isinstance(decoded, dict) else None
    if isinstance(encoded.get("code"), dict):
        out["code"] = _code_summary(encoded["code"])
    return out


def _code_summary(code: dict[str, Any]) -> dict[str, Any]:
    files = code.get("files")
    return {
        "files_sha256": code.get("files_sha256"),
        "git_commit": code.get("git_commit"),
        "git_dirty": code.get("git_dirty"),
        "n_files": len(files) if isinstance(files, dict) else None,
    }


def _inspect_bin(p: Path, given: str | Path, *, check_finite: bool, deep: bool) -> dict[str, Any]:
    from ..formats import companion as companion_fmt
    from ..formats.andrea_bin import companion_path, describe_missing, parse_bin_name, read_header
    from ..io.fsio import sha256_file

    report = _base(given, "bin", check_finite, deep)
    v = _Verdict()
    size, raw_step, raw_n = _raw_header(p)
    comp = companion_path(p)
    section: dict[str, Any] = {
        "file": str(p),
        "size": size,
        "expected_size": None if raw_n is None else 8 + 12 * raw_n,
        "size_ok": None,
        "header": None if raw_n is None else {"step": raw_step, "n_params": raw_n},
        "name_step": parse_bin_name(p.name),
        "sha256": None,
        "full_pass": False,
        "sidecar": None,
        "companion": None,
        "lacks": [],
        "regions": None,
        "finite": {"checked": check_finite, "ok": None},
    }
    report["bin"] = section
    header = None
    try:
        header = read_header(p)
        section["size_ok"] = True
    except IntegrityError as exc:
        section["size_ok"] = section["expected_size"] == size if section["expected_size"] is not None else False
        report["error"] = exc.as_dict()
        v.fail(_err_text(exc), exc.exit_code)

    if header is not None and section["name_step"] is not None and section["name_step"] != header.step:
        v.fail(f"the file is named for step {section['name_step']} but its header says step {header.step}")

    # sidecar / commit marker
    sidecar = _bin_sidecar(p, comp)
    section["sidecar"] = sidecar
    if sidecar["error"]:
        v.fail(f"sha256 sidecar: {sidecar['error']}", sidecar.pop("error_exit_code", 1))
    # companion
    cinfo: dict[str, Any] = {
        "path": str(comp),
        "present": os.path.lexists(comp),
        "error": None,
        "record": None,
        "disagreements": [],
        "state_keys": [],
        "progress": None,
        "versions": None,
        "code": None,
        "data_identity": None,
        "state_valid": None,
    }
    section["companion"] = cinfo
    record: dict[str, Any] | None = None
    if cinfo["present"]:
        try:
            doc = companion_fmt.read_companion(comp)
            record = doc["bin"]
            cinfo["record"] = record
            cinfo.update(_state_summary(doc.get("state")))
            if deep:  # the validation a resume runs (store.load): inspect only renders its result
                from ..store.store import _malformed_companion, _validate_state

                with _malformed_companion(comp):
                    _validate_state(companion_fmt.decode_tree(doc["state"]), comp)
                cinfo["state_valid"] = True
        except RipresaError as exc:
            cinfo["error"] = _err_text(exc)
            v.fail(f"companion: {cinfo['error']}", exc.exit_code)
    section["lacks"] = describe_missing(p)
    if not sidecar["present"] and cinfo["present"]:
        v.warn(f"no commit marker '{Path(sidecar['path']).name}' beside the companion: this generation was never "
               "committed, and a run folder's resume skips it (the .bin is checked against the companion's sha256)")
    elif not sidecar["present"]:
        v.warn(f"no sha256 sidecar '{Path(sidecar['path']).name}': nothing vouches for the content")
    if not cinfo["present"]:
        v.warn(f"no companion '{comp.name}': not a complete resume point (weights, m and v load; see 'lacks')")

    # the full pass: sha256 + statistics (+ finite counts)
    if header is not None and (deep or check_finite):
        try:
            digest, stats = scan_bin(p, header.step, header.n_params)
        except RipresaError as exc:
            v.fail(_err_text(exc), exc.exit_code)
        else:
            section["sha256"] = digest
            section["full_pass"] = True
            section["regions"] = {name: s.as_dict() for name, s in stats.items()}
            bad = [(name, s) for name, s in stats.items() if s.nonfinite]
            if check_finite:
                section["finite"]["ok"] = not bad
            for name, s in bad:
                first = s.first_nonfinite or {}
                text = (
                    f"{name} holds {s.nonfinite} non-finite value(s) (NaN {s.nan}, +Inf {s.posinf}, -Inf {s.neginf}); "
                    f"first {name}[{first.get('index')}] = {first.get('value')} at byte offset {first.get('offset')}"
                )
                if check_finite:
                    v.fail(text)
                else:
                    v.warn(text + " (use --check-finite to fail on it)")
    elif header is not None:
        v.warn("--no-deep: the .bin was not read in full; its sha256 and statistics were not computed")

    # hash lines
    digest = section["sha256"]
    for line in sidecar["lines"]:
        if line["name"] == p.name:
            if digest is not None:
                line["actual"] = digest
                line["ok"] = digest == line["expected"]
                if not line["ok"]:
                    v.fail(f"sha256 mismatch: {p.name} is not the file its sidecar vouches for "
                           f"(expected {line['expected']}, found {digest})")
        else:  # the companion line of a generation marker
            if _regular(comp):
                try:
                    line["actual"] = sha256_file(comp, what="companion").sha256
                except RipresaError as exc:
                    v.fail(f"companion: {_err_text(exc)}", exc.exit_code)
                else:
                    line["ok"] = line["actual"] == line["expected"]
                    if not line["ok"]:
                        v.fail(f"sha256 mismatch: {comp.name} changed after the commit "
                               f"(expected {line['expected']}, found {line['actual']})")
            else:
                line["ok"] = False
                v.fail(f"the commit marker names {comp.name}, which is missing or not a regular file")

    # companion record against the .bin
    if record is not None:
        dis = cinfo["disagreements"]
        if record.get("name") != p.name:
            dis.append(f"name: companion says {record.get('name')!r}, file is {p.name!r}")
        if record.get("size") != size:
            dis.append(f"size: companion says {record.get('size')}, file has {size} bytes")
        if header is not None:
            if record.get("step") != header.step:
                dis.append(f"step: companion says {record.get('step')}, header says {header.step}")
            if record.get("n_params") != header.n_params:
                dis.append(f"n_params: companion says {record.get('n_params')}, header says {header.n_params}")
        marker_lines = [line for line in sidecar["lines"] if line["name"] == p.name]
        for line in marker_lines:  # the marker line itself is checked against the file above
            if record.get("sha256") != line["expected"]:
                dis.append(f"sha256: companion says {record.get('sha256')}, the marker says {line['expected']}")
        if not marker_lines and digest is not None and record.get("sha256") != digest:
            dis.append(f"sha256: companion says {record.get('sha256')}, file hashes to {digest}")
        for d in dis:
            v.fail(f"companion and .bin disagree: {d}")
    return _finish(report, v)


# ---- checkpoint.pt -----------------------------------------------------------------


def _pt_sidecar_after_failure(p: Path) -> dict[str, Any]:
    from ..io.fsio import read_sidecar, sha256_file, sidecar_path

    side = sidecar_path(p)
    info: dict[str, Any] = {"path": str(side), "present": os.path.lexists(side), "expected": None, "actual": None,
                            "ok": None, "error": None}
    if info["present"]:
        try:
            info["expected"] = read_sidecar(p)
        except RipresaError as exc:
            info["error"] = _err_text(exc)
    try:
        info["actual"] = sha256_file(p, what="checkpoint").sha256
    except RipresaError as exc:
        info["error"] = info["error"] or _err_text(exc)
    if info["expected"] is not None and info["actual"] is not None:
        info["ok"] = info["expected"] == info["actual"]
    elif not info["present"]:
        info["ok"] = False
    return info


def _inspect_pt(p: Path, given: str | Path, *, check_finite: bool, deep: bool, note: str | None = None) -> dict[str, Any]:
    import torch

    from ..errors import SchemaError
    from ..formats.torch_pt import load_checkpoint
    from ..io.fsio import sidecar_path

    report = _base(given, "checkpoint.pt", check_finite, deep)
    v = _Verdict()
    if note:
        v.notes.append(note)
    section: dict[str, Any] = {
        "file": str(p),
        "size": p.stat().st_size,
        "sidecar": None,
        "schema_ok": None,
        "progress": None,
        "versions": None,
        "code": None,
        "data_identity": None,
        "config": None,
        "lineage": None,
        "extra_keys": None,
        "model": None,
        "optimizer": None,
        "scheduler": None,
        "scaler": None,
        "data": None,
        "rng": None,
        "objects": None,
        "finite": {"checked": check_finite, "ok": None},
    }
    report["checkpoint"] = section
    try:
        ck = load_checkpoint(p)
    except RipresaError as exc:
        report["error"] = exc.as_dict()
        v.fail(_err_text(exc), exc.exit_code)
        section["sidecar"] = _pt_sidecar_after_failure(p)
        if section["sidecar"]["ok"] and isinstance(exc, IntegrityError):
            section["schema_ok"] = False if isinstance(exc, SchemaError) else None
        return _finish(report, v)

    side = sidecar_path(p)
    section["sidecar"] = {"path": str(side), "present": True, "expected": ck.digest.sha256,
                          "actual": ck.digest.sha256, "ok": True, "error": None}
    section["schema_ok"] = True
    s = ck.state
    section["progress"] = s["progress"]
    section["versions"] = s["versions"]
    section["code"] = _code_summary(s["code"])
    section["data_identity"] = s["data_identity"]
    section["config"] = s["config"]
    section["lineage"] = s["lineage"]
    section["extra_keys"] = sorted(map(str, s["extra"]))

    # model tensors
    model_stats = Stats()
    dtypes: dict[str, int] = {}
    entries = []
    elements = floating = 0
    for name, t in s["model"].items():
        dt = str(t.dtype).removeprefix("torch.")
        dtypes[dt] = dtypes.get(dt, 0) + 1
        elements += t.numel()
        entries.append({"name": name, "shape": list(t.shape), "dtype": dt, "numel": t.numel()})
        if t.is_floating_point():
            floating += t.numel()
            _add_tensor(model_stats, t, f"model.{name}")
    section["model"] = {"tensors": len(entries), "elements": elements, "floating_elements": floating,
                        "dtypes": dtypes, "stats": model_stats.as_dict(), "entries": entries}
    all_stats: list[Stats] = [model_stats]

    # optimizer
    opt = s["optimizer"]
    if opt is not None:
        groups = []
        for g in opt["param_groups"]:
            row = {"n_params": len(g.get("params", []))}
            row.update({k: val for k, val in g.items() if k != "params"})
            groups.append(row)
        by_key: dict[str, Stats] = {}
        steps: set[float] = set()
        alias = {"exp_avg": "m", "exp_avg_sq": "v"}
        for idx, st in opt["state"].items():
            if not isinstance(st, dict):
                continue
            for key, t in st.items():
                if key == "step":
                    steps.add(float(t.item() if isinstance(t, torch.Tensor) else t))
                elif isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0:
                    _add_tensor(by_key.setdefault(alias.get(key, key), Stats()), t, f"optimizer.state[{idx}].{key}")
        section["optimizer"] = {
            "param_groups": groups,
            "params_with_state": len(opt["state"]),
            "steps": sorted(int(x) if x == int(x) else x for x in steps),
            "state": {k: st.as_dict() for k, st in by_key.items()},
        }
        all_stats.extend(by_key.values())

    sched = s["scheduler"]
    section["scheduler"] = None if sched is None else {
        k: sched[k] for k in ("last_epoch", "_last_lr", "base_lrs") if k in sched
    } | {"keys": sorted(map(str, sched))}
    section["scaler"] = s["scaler"]
    section["data"] = s["data"]
    section["rng"] = sorted(k for k, val in s["rng"].items() if val is not None)
    section["objects"] = sorted(map(str, s["objects"]))

    bad = [st for st in all_stats if st.nonfinite]
    if check_finite:
        section["finite"]["ok"] = not bad
    for st in bad:
        first = st.first_nonfinite or {}
        text = f"{st.nonfinite} non-finite value(s); first {first.get('where')}[{first.get('index')}] = {first.get('value')}"
        if check_finite:
            v.fail(text)
        else:
            v.warn(text + " (use --check-finite to fail on it)")
    return _finish(report, v)


# ---- run folder --------------------------------------------------------------------


def _inspect_folder(p: Path, given: str | Path, *, check_finite: bool, deep: bool) -> dict[str, Any]:
    from ..io.lock import read_lock_holder
    from ..store.store import CheckpointStore

    store = CheckpointStore(p, writer=False)
    steps = store.steps_on_disk()
    pt = p / "checkpoint.pt"
    if not steps and _regular(pt):
        return _inspect_pt(pt, given, check_finite=check_finite, deep=deep,
                           note=f"{p} holds no generation; inspected its checkpoint.pt")

    report = _base(given, "run", check_finite, deep)
    v = _Verdict()
    from ..store.backend import backend_of, registered

    # Every registered kind side by side: .bin (single process / DDP), .dcp (FSDP2), ...
    gens: list[Any] = [g for kind in registered() for g in backend_of(kind, store).generations(deep=deep)]
    gens.sort(key=lambda g: g.step)
    valid = [g for g in gens if g.valid]
    # The resume of a single-process or DDP run considers .bin generations only; an
    # FSDP2 run's considers its .dcp ones first. A folder holding .bin generations is
    # reported as the former (a .dcp planted beside them is never what it resumes).
    # A single-process resume considers every kind registered for it (.bin, general .safetensors, ...).
    single = {k for k, spec in registered().items() if "single" in spec.modes}
    valid_bins = [g for g in valid if getattr(g, "kind", "bin") in single]
    valid_dcps = [g for g in valid if getattr(g, "kind", "bin") == "dcp"]
    has_single = any(getattr(g, "kind", "bin") in single for g in gens)
    resume = (valid_bins or valid_dcps or [None])[-1] if not has_single else (valid_bins or [None])[-1]
    mixed = bool(steps) and any(getattr(g, "kind", "bin") == "dcp" for g in gens)
    rows = []
    for g in gens:
        is_dcp = getattr(g, "kind", "bin") == "dcp"
        main = g.path if is_dcp else g.bin
        try:
            size = g.size if is_dcp else (os.lstat(main).st_size if os.path.lexists(main) else None)
        except OSError:
            size = None
        rows.append({
            "step": g.step,
            "kind": getattr(g, "kind", "bin"),
            "valid": g.valid,
            "reason": g.reason,
            "size": size,
            "deep_checked": g.deep_checked,
            "resume": resume is not None and g is resume,
            "files": {getattr(g, "kind", "bin"): os.path.lexists(main), "companion": os.path.lexists(g.companion),
                      "marker": os.path.lexists(g.marker)},
            "checks": [c.as_dict() for c in g.checks],
        })

    lock: dict[str, Any] = {"held": False, "pid": None, "hostname": None, "started": None, "argv": None, "error": None}
    try:
        holder = read_lock_holder(p)
    except RipresaError as exc:
        lock["held"] = True
        lock["error"] = _err_text(exc)
    else:
        if holder is not None:
            lock.update(held=True, pid=holder.pid, hostname=holder.hostname, started=holder.started,
                        argv=list(holder.argv) if holder.argv else None)

    temps = []
    for entry in sorted(os.scandir(p), key=lambda e: e.name):
        pid = temp_name_pid(entry.name)  # bounded digits: never an OverflowError
        if pid is None:
            continue
        try:
            tsize = entry.stat(follow_symlinks=False).st_size
        except OSError:
            tsize = None
        temps.append({"name": entry.name, "size": tsize, "pid": pid, "writer_alive": pid_alive(pid)})

    finite: dict[str, Any] = {"checked": check_finite, "ok": None, "step": None, "regions": None}
    report["run"] = {
        "folder": str(p),
        "generations": rows,
        "resume_step": resume.step if resume else None,
        "lock": lock,
        "temporaries": temps,
        "finite": finite,
    }

    if not gens:
        v.fail(f"no generation in {p}: a resume would find nothing")
    elif resume is None and mixed and valid_dcps:
        v.fail(f"no valid .bin generation: a single-process or DDP resume would find nothing "
               f"(an FSDP2 resume would use .dcp generation {valid_dcps[-1].step})")
    elif resume is None:
        v.fail(f"none of the {len(gens)} generation(s) is valid: a resume would find nothing")
    else:
        for g in gens:
            if not g.valid and g.step > resume.step:
                v.warn(f"generation {g.step} is invalid and a resume skips it: {g.reason}")
            elif not g.valid:
                v.warn(f"older generation {g.step} is invalid: {g.reason}")
    if mixed:
        v.warn("this folder holds .bin and .dcp generations: every resume takes the newest valid one; at equal "
               "steps a single-process or DDP run prefers the .bin, an FSDP2 run the .dcp (see docs/SHARDED.md)")
    if not deep and gens:
        v.warn("--no-deep: .bin files were not re-hashed; a flipped bit inside one goes unnoticed")
    for t in temps:
        if t["writer_alive"]:
            v.warn(f"temporary file {t['name']}: a save in progress by pid {t['pid']}")
        else:
            v.warn(f"leftover temporary file {t['name']} of a dead writer (pid {t['pid']}); "
                   "the next writer removes it")

    if check_finite and resume is not None and getattr(resume, "kind", "bin") != "bin":
        v.warn(f"--check-finite reads .bin generations; generation {resume.step} is a {resume.path.suffix} "
               "(its files were hashed)")
    elif check_finite and resume is not None:
        finite["step"] = resume.step
        try:
            from ..formats.andrea_bin import read_header

            h = read_header(resume.bin)
            digest, stats = scan_bin(resume.bin, h.step, h.n_params)
        except RipresaError as exc:
            v.fail(_err_text(exc), exc.exit_code)
        else:
            finite["regions"] = {name: st.as_dict() for name, st in stats.items()}
            bad = [(name, st) for name, st in stats.items() if st.nonfinite]
            finite["ok"] = not bad
            if resume.bin_sha256 is not None and digest != resume.bin_sha256:
                v.fail(f"sha256 mismatch: {resume.bin.name} changed while it was inspected")
            for name, st in bad:
                first = st.first_nonfinite or {}
                v.fail(f"generation {resume.step} (the one a resume uses) holds {st.nonfinite} non-finite "
                       f"value(s) in {name}; first {name}[{first.get('index')}] = {first.get('value')}")
    return _finish(report, v)


# ---- rendering ---------------------------------------------------------------------


def _fmt(x: Any) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def _size(n: Any) -> str:
    if not isinstance(n, int):
        return "—"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    f, i = float(n), 0
    while f >= 1024 and i < len(units) - 1:
        f /= 1024
        i += 1
    return f"{n} bytes" if i == 0 else f"{n} bytes ({f:.1f} {units[i]})"


def _short_size(n: Any) -> str:
    text = _size(n)
    return text[text.index("(") + 1 : -1] if "(" in text else text


def _status(ok: Any) -> str:
    if ok is True:
        return "[green]ok[/]"
    if ok is False:
        return "[red]FAIL[/]"
    return "[dim]not checked[/]"


def _stats_table(title: str, stats: dict[str, Any], width: int) -> Any:
    """One row per region or group, laid out across when it fits ``width`` and down otherwise (no number is
    wrapped or cut: ripresa.console.fit_table); where the first non-finite value is, the problems/warnings say."""
    from rich.markup import escape

    from ..console import fit_table

    rows = []
    for name, s in stats.items():
        bad = s["nan"] + s["posinf"] + s["neginf"]
        detail = f"[red]{bad}[/]" if bad else "0"
        rows.append([escape(name), str(s["count"]), _fmt(s["min"]), _fmt(s["max"]), _fmt(s["mean"]), _fmt(s["std"]), detail])
    return fit_table(title, ("", "count", "min", "max", "mean", "std", "non-finite"), rows, width)


def render_report(report: dict[str, Any], console: Any = None) -> None:
    """Print a report as rich tables, then problems, warnings and the verdict."""
    from rich.markup import escape

    from ..text import safe_console

    console = console or safe_console()
    kind = report["kind"]
    if kind == "bin":
        _render_bin(report["bin"], console, deep=report["options"]["deep"])
    elif kind == "checkpoint.pt":
        _render_pt(report["checkpoint"], console)
    elif kind == "run":
        _render_run(report["run"], console)
    elif kind == "dcp" and report.get("dcp"):
        from .inspect_dcp import render_dcp

        render_dcp(report["dcp"], console)
    elif kind == "safetensors":
        from .inspect_general import render_safetensors

        render_safetensors(report["safetensors"], console)
    for text in report["problems"]:
        console.print(f"[red]problem:[/] {escape(text)}")
    for text in report["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(text)}")
    for text in report["notes"]:
        console.print(f"note: {escape(text)}")
    if report["ok"]:
        console.print(f"[bold green]OK[/] {escape(report['path'])} (exit 0)")
    else:
        console.print(f"[bold red]FAILED[/] {escape(report['path'])} (exit {report['exit_code']})")


def _render_bin(b: dict[str, Any], console: Any, *, deep: bool) -> None:
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"ANDREA .bin — {escape(b['file'])}", show_header=False)
    t.add_column("field", no_wrap=True)
    t.add_column("value", overflow="fold")
    h = b["header"] or {}
    t.add_row("step", _fmt(h.get("step")) + (f"  (name says {b['name_step']})" if b["name_step"] is not None else ""))
    t.add_row("n_params", _fmt(h.get("n_params")))
    t.add_row("size", ("[green]" if b["size_ok"] else "[red]") + escape(_size(b["size"])) + "[/]")
    if h.get("n_params") is not None:
        t.add_row("expected size", f"{b['expected_size']} bytes = 8 + 12 x {h['n_params']}")
    t.add_row("sha256", b["sha256"] or ("[dim]not computed (--no-deep)[/]" if not deep else "[dim]not computed (the file failed its header or size check)[/]"))
    side = b["sidecar"]
    if not side["present"]:
        t.add_row("sidecar", "[yellow]missing[/] — nothing vouches for the content")
    elif side["error"]:
        t.add_row("sidecar", f"[red]{escape(side['error'])}[/]")
    else:
        t.add_row("sidecar", f"{side['kind']} ({escape(Path(side['path']).name)})")
        for line in side["lines"]:
            t.add_row(f"  {escape(line['name'])}", f"{_status(line['ok'])}  expected {line['expected']}"
                      + (f", found {line['actual']}" if line["ok"] is False and line["actual"] else ""))
    c = b["companion"]
    if not c["present"]:
        t.add_row("companion", f"[yellow]missing[/] ({escape(Path(c['path']).name)})")
    elif c["error"]:
        t.add_row("companion", f"[red]{escape(c['error'])}[/]")
    else:
        agree = "[green]agrees with the .bin[/]" if not c["disagreements"] else "[red]disagrees with the .bin[/]"
        t.add_row("companion", f"{escape(Path(c['path']).name)}: {agree}")
        if c["progress"] is not None:
            t.add_row("  progress", escape(str(c["progress"])))
        if c["versions"] is not None:
            t.add_row("  versions", escape(", ".join(f"{k} {val}" for k, val in c["versions"].items()
                                                     if k in ("python", "torch", "numpy", "ripresa"))))
        if c["code"] is not None:
            t.add_row("  code", escape(f"{c['code']['files_sha256']} (git {c['code']['git_commit']}, dirty {c['code']['git_dirty']})"))
    t.add_row("finite", "[dim]not checked[/]" if not b["finite"]["checked"] else _status(b["finite"]["ok"]))
    console.print(t)
    if b["lacks"]:
        console.print("[yellow]a resume from this file lacks:[/]")
        for line in b["lacks"]:
            console.print(f"  {escape(line)}")
    if b["regions"]:
        console.print(_stats_table("weights, m, v (float64 statistics over finite values)", b["regions"], console.width))


def _render_pt(c: dict[str, Any], console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"checkpoint.pt — {escape(c['file'])}", show_header=False)
    t.add_column("field", no_wrap=True)
    t.add_column("value", overflow="fold")
    t.add_row("size", _size(c["size"]))
    side = c["sidecar"] or {}
    if not side.get("present"):
        t.add_row("sidecar", "[red]missing[/]")
    else:
        t.add_row("sidecar", f"{_status(side.get('ok'))}  expected {side.get('expected')}"
                  + (f", found {side.get('actual')}" if side.get("ok") is False else ""))
    if side.get("error"):
        t.add_row("", f"[red]{escape(side['error'])}[/]")
    t.add_row("schema", _status(c["schema_ok"]))
    if c["progress"] is not None:
        t.add_row("progress", escape(", ".join(f"{k} {val}" for k, val in c["progress"].items())))
    if c["versions"] is not None:
        t.add_row("versions", escape(", ".join(f"{k} {val}" for k, val in c["versions"].items())))
    if c["code"] is not None:
        code = c["code"]
        t.add_row("code", escape(f"{code['files_sha256']} ({code['n_files']} files; git {code['git_commit']}, dirty {code['git_dirty']})"))
    if c["data_identity"] is not None:
        t.add_row("data identity", escape(", ".join(f"{k} {val}" for k, val in c["data_identity"].items()) or "—"))
    if c["model"] is not None:
        m = c["model"]
        t.add_row("model", f"{m['tensors']} tensors, {m['elements']} elements "
                  f"({m['floating_elements']} floating), dtypes {escape(str(m['dtypes']))}")
    if c["optimizer"] is not None:
        o = c["optimizer"]
        t.add_row("optimizer", f"{len(o['param_groups'])} group(s), {o['params_with_state']} parameter(s) with state, "
                  f"steps {o['steps']}")
        for i, g in enumerate(o["param_groups"]):
            keys = ("lr", "betas", "eps", "weight_decay")
            t.add_row(f"  group {i}", escape(f"{g['n_params']} params, " + ", ".join(f"{k} {g[k]}" for k in keys if k in g)))
    if c["scheduler"] is not None:
        t.add_row("scheduler", escape(str({k: val for k, val in c["scheduler"].items() if k != "keys"})))
    if c["rng"] is not None:
        t.add_row("random streams", escape(", ".join(c["rng"])))
    if c["data"] is not None:
        d = c["data"]
        t.add_row("data position", escape(", ".join(f"{k} {val}" for k, val in d.items() if not isinstance(val, dict))))
    t.add_row("finite", "[dim]not checked[/]" if not c["finite"]["checked"] else _status(c["finite"]["ok"]))
    console.print(t)
    groups: dict[str, Any] = {}
    if c["model"] is not None:
        groups["model"] = c["model"]["stats"]
    if c["optimizer"] is not None:
        groups.update({f"optimizer {k}": s for k, s in c["optimizer"]["state"].items()})
    if groups:
        console.print(_stats_table("tensor groups (float64 statistics over finite values)", groups, console.width))


def _render_run(r: dict[str, Any], console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    if not r["generations"]:
        console.print(f"run folder {escape(r['folder'])}: [red]no generation[/] (no step_NNNNNN.bin, .json or .bin.sha256)")
    t = Table(title=f"run folder — {escape(r['folder'])}")
    for col in ("step", "kind", "size", "status", "resume", "reason"):  # numbers on one line, text folds
        t.add_column(col, justify="right" if col in ("step", "size") else "left", no_wrap=col in ("step", "kind", "size"),
                     overflow="fold")
    for g in r["generations"]:
        files = g["files"]
        status = "[green]valid[/]" if g["valid"] else "[red]INVALID[/]"
        if g["valid"] and not g["deep_checked"]:
            status += " [dim](not re-hashed)[/]"
        missing = [k for k, present in files.items() if not present]
        reason = g["reason"] or ""
        failed = next((c for c in g.get("checks") or [] if not c["ok"]), None)
        if failed is not None:
            reason = f"check '{failed['name']}' failed: {reason}"
        if missing and not g["valid"]:
            reason = f"missing {', '.join(missing)}; " + reason
        t.add_row(str(g["step"]), escape(str(g.get("kind", "bin"))), _short_size(g["size"]), status,
                  "[bold]← resume uses this[/]" if g["resume"] else "", escape(reason))
    if r["generations"]:
        console.print(t)
    if r["resume_step"] is not None:
        console.print(f"a resume would use generation [bold]{r['resume_step']}[/]")
    else:
        console.print("[red]a resume would find no valid generation[/]")
    lock = r["lock"]
    if lock["held"]:
        who = f"pid {lock['pid']}" if lock["pid"] is not None else "an unknown process"
        if lock["hostname"] and lock["hostname"] != socket.gethostname():
            who += f" on host {lock['hostname']}"
        console.print(f"LOCK held by a live writer: [bold]{escape(who)}[/]" + (f" ({escape(lock['error'])})" if lock["error"] else ""))
    else:
        console.print("LOCK: no live writer")
    if r["temporaries"]:
        tt = Table(title="temporary files")
        for col in ("name", "size", "writer pid", "writer"):
            tt.add_column(col)
        for tmp in r["temporaries"]:
            tt.add_row(escape(tmp["name"]), _size(tmp["size"]), str(tmp["pid"]),
                       "alive (save in progress)" if tmp["writer_alive"] else "dead (leftover)")
        console.print(tt)
    if r["finite"]["regions"]:
        console.print(_stats_table(f"generation {r['finite']['step']} (the one a resume uses)", r["finite"]["regions"], console.width))


__all__ = ["SCHEMA", "SCHEMA_VERSION", "STAT_BLOCK", "Stats", "error_report", "inspect_path", "render_report", "scan_bin"]
