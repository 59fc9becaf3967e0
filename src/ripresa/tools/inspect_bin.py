"""``ripresa inspect FILE.bin``: an ANDREA ``.bin``, its commit marker and companion, one streaming pass.

The header and size, the sidecar (a generation's marker or a sha256sum
line), the companion's record and state (the validation a resume runs), then
one pass that hashes the file and computes per-region statistics
(:func:`scan_bin`). What is checked and the report's keys: docs/INSPECT.md.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import IntegrityError, RipresaError
from .report import (
    STAT_BLOCK,
    Stats,
    Verdict,
    base_report,
    err_text,
    finish,
    fmt,
    fmt_size,
    fmt_status,
    regular,
    state_summary,
    stats_table,
)


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


def _line_count(p: Path) -> int:
    """Lines of a small regular file (0 if it is not one); never follows links or blocks."""
    if not regular(p):
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
        info["error"] = err_text(exc)
        info["error_exit_code"] = exc.exit_code
    return info


def inspect_bin(p: Path, given: str | Path, *, check_finite: bool, deep: bool) -> dict[str, Any]:
    from ..formats import companion as companion_fmt
    from ..formats.andrea_bin import companion_path, describe_missing, parse_bin_name, read_header
    from ..io.fsio import sha256_file

    report = base_report(given, "bin", check_finite, deep)
    v = Verdict()
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
        v.fail(err_text(exc), exc.exit_code)

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
            cinfo.update(state_summary(doc.get("state")))
            if deep:  # the validation a resume runs (store.load): inspect only renders its result
                from ..store.commit import malformed_companion, validate_state

                with malformed_companion(comp):
                    validate_state(companion_fmt.decode_tree(doc["state"]), comp)
                cinfo["state_valid"] = True
        except RipresaError as exc:
            cinfo["error"] = err_text(exc)
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
            v.fail(err_text(exc), exc.exit_code)
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
            if regular(comp):
                try:
                    line["actual"] = sha256_file(comp, what="companion").sha256
                except RipresaError as exc:
                    v.fail(f"companion: {err_text(exc)}", exc.exit_code)
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
    return finish(report, v)


def render_bin(b: dict[str, Any], console: Any, *, deep: bool) -> None:
    from rich.markup import escape

    from ..console import KeyValues

    t = KeyValues(f"ANDREA .bin — {escape(b['file'])}")  # a hash or a path on its own line, never cut (docs/INSPECT.md, "80 columns")
    h = b["header"] or {}
    t.add_row("step", fmt(h.get("step")) + (f"  (name says {b['name_step']})" if b["name_step"] is not None else ""))
    t.add_row("n_params", fmt(h.get("n_params")))
    t.add_row("size", ("[green]" if b["size_ok"] else "[red]") + escape(fmt_size(b["size"])) + "[/]")
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
            t.add_row(f"  {escape(line['name'])}", f"{fmt_status(line['ok'])}  expected {line['expected']}"
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
    t.add_row("finite", "[dim]not checked[/]" if not b["finite"]["checked"] else fmt_status(b["finite"]["ok"]))
    console.print(t)
    if b["lacks"]:
        console.print("[yellow]a resume from this file lacks:[/]")
        for line in b["lacks"]:
            console.print(f"  {escape(line)}")
    if b["regions"]:
        console.print(stats_table("weights, m, v (float64 statistics over finite values)", b["regions"], console.width))
