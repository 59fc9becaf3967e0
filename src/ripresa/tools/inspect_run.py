"""``ripresa inspect RUN``: every generation of a run folder, the one a resume would use, the lock, leftovers.

Read-only: nothing is written, locked or deleted. What is checked and the
report's keys: docs/INSPECT.md.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from ..console import capped, capped_rows, more_line
from ..errors import RipresaError
from ..io.fsio import temp_name_pid
from ..io.lock import pid_alive
from ..store.memory import peek, tier_folder
from .inspect_bin import scan_bin
from .inspect_pt import inspect_pt
from .report import (
    Verdict,
    base_report,
    err_text,
    finish,
    fmt_short_size,
    fmt_size,
    regular,
    stats_table,
)


def inspect_run(p: Path, given: str | Path, *, check_finite: bool, deep: bool) -> dict[str, Any]:
    from ..io.lock import read_lock_holder
    from ..store.store import CheckpointStore

    store = CheckpointStore(p, writer=False)
    steps = store.steps_on_disk()
    pt = p / "checkpoint.pt"
    if not steps and regular(pt):
        return inspect_pt(pt, given, check_finite=check_finite, deep=deep,
                           note=f"{p} holds no generation; inspected its checkpoint.pt")

    report = base_report(given, "run", check_finite, deep)
    v = Verdict()
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
    sharded = {k for k, spec in registered().items() if spec.collective}  # .dcp: every rank writes part of it
    folders = {k for k, spec in registered().items() if spec.naming is not None and spec.naming.folder}
    valid_bins = [g for g in valid if getattr(g, "kind", "bin") in single]
    valid_dcps = [g for g in valid if getattr(g, "kind", "bin") in sharded]
    has_single = any(getattr(g, "kind", "bin") in single for g in gens)
    resume = (valid_bins or valid_dcps or [None])[-1] if not has_single else (valid_bins or [None])[-1]
    mixed = bool(steps) and any(getattr(g, "kind", "bin") in sharded for g in gens)
    rows = []
    for g in gens:
        is_folder = getattr(g, "kind", "bin") in folders  # a folder kind: its size is the generation's
        main = g.path if is_folder else g.bin
        try:
            size = g.size if is_folder else (os.lstat(main).st_size if os.path.lexists(main) else None)
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
        lock["error"] = err_text(exc)
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
        "memory": {"folder": str(tier_folder(p)), "generations": peek(p)},
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
            v.fail(err_text(exc), exc.exit_code)
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
    return finish(report, v)


def render_run(r: dict[str, Any], console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    if not r["generations"]:
        console.print(f"run folder {escape(r['folder'])}: [red]no generation[/] (no step_NNNNNN.bin, .json or .bin.sha256)")
    console.print(f"run folder — {escape(r['folder'])}")  # above the table: a long path wraps whole, never split
    t = Table()
    for col in ("step", "kind", "size", "status", "resume", "reason"):  # numbers on one line, text folds
        t.add_column(col, justify="right" if col in ("step", "size") else "left", no_wrap=col in ("step", "kind", "size"),
                     overflow="fold")
    shown, more = capped(r["generations"][::-1])  # the newest, the ones a resume looks at
    if more:
        t.add_row("", "", "", "", "", more_line(more, "older generations"))
    for g in shown[::-1]:
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
        t.add_row(str(g["step"]), escape(str(g.get("kind", "bin"))), fmt_short_size(g["size"]), status,
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
    for m in r.get("memory", {}).get("generations", []):
        where = f"memory tier: step {m['step']} in {escape(r['memory']['folder'])}"
        if not m["usable"]:
            console.print(f"{where}: [red]not usable[/] ({escape(str(m['reason']))})")
        elif r["resume_step"] is None or m["step"] > r["resume_step"]:
            console.print(f"{where}: [bold]newer than the disk[/]: the same command (memory_every on) resumes from it")
        else:
            console.print(f"{where}: not newer than the disk's generation {r['resume_step']}")
    if r["temporaries"]:
        tt = Table(title="temporary files")
        for col in ("name", "size", "writer pid", "writer"):
            tt.add_column(col)
        capped_rows(tt, r["temporaries"], lambda tmp: (escape(tmp["name"]), fmt_size(tmp["size"]), str(tmp["pid"]),
                    "alive (save in progress)" if tmp["writer_alive"] else "dead (leftover)"), what="temporary files")
        console.print(tt)
    if r["finite"]["regions"]:
        console.print(stats_table(f"generation {r['finite']['step']} (the one a resume uses)", r["finite"]["regions"], console.width))
