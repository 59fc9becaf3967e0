"""Shared pieces of the fault matrix: deterministic generations, forked children, the ledger.

Every fault test counts its cases and records one line per family in the
ledger named by ``RIPRESA_FAULTS_LEDGER`` (set by ``tests/faults/report.py``,
i.e. ``make test-faults``), then asserts: a case that loses data fails the
test *and* shows in the table. ``RIPRESA_FAULTS_FULL=1`` runs the whole
matrix; without it (``make test``) each family runs a sample.
"""

from __future__ import annotations

import json
import os
import random
import sys
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ripresa.formats.andrea_bin import BinArrays
from ripresa.io import fsio
from ripresa.store.store import CheckpointStore, CheckpointWarning

torch.set_num_threads(1)

#: The whole matrix (make test-faults) or a sample of each family (make test).
FULL = os.environ.get("RIPRESA_FAULTS_FULL") == "1"
LEDGER_ENV = "RIPRESA_FAULTS_LEDGER"
#: A test key for the signed variants (32 bytes).
KEY = b"ripresa-fault-matrix-test-key-32"


def scale(sample: int, full: int) -> int:
    """Cases to run: ``full`` in the long run, ``sample`` in the default suite."""
    return full if FULL else sample


def pick(cases: list, sample: int, seed: int = 0) -> list:
    """All of ``cases`` in the long run; an evenly spread sample (first and last included) otherwise."""
    if FULL or len(cases) <= sample:
        return list(cases)
    if sample <= 1:
        return cases[:1]
    idx = sorted({round(i * (len(cases) - 1) / (sample - 1)) for i in range(sample)})
    return [cases[i] for i in idx]


# ---------------------------------------------------------------- deterministic generations

def arrays_for(step: int, n: int, writer: int = 0) -> BinArrays:
    """Weights/m/v that depend only on (step, n, writer), so a reader checks them bitwise."""
    g = np.random.default_rng([step, n, writer])
    w, m, v = (g.standard_normal(n).astype(np.float32) for _ in range(3))
    return BinArrays((w,), (m,), (np.abs(v),))


def companion_for(step: int, writer: int = 0) -> dict[str, Any]:
    return {"progress": {"step": step}, "writer": writer, "note": f"generation {step} by {writer}",
            "t": torch.arange(4, dtype=torch.float64) * step}


def generation_matches(contents, comp: dict, step: int, n: int, writer: int | None = None) -> bool:
    """The loaded generation is exactly what was saved for ``step`` (by ``writer``, or the one it names)."""
    w = comp.get("writer") if writer is None else writer
    if not isinstance(w, int):
        return False
    exp = arrays_for(step, n, w)
    return (
        contents.step == step
        and contents.n_params == n
        and np.array_equal(contents.weights, exp.weights[0])
        and np.array_equal(contents.m, exp.m[0])
        and np.array_equal(contents.v, exp.v[0])
        and comp.get("progress") == {"step": step}
        and comp.get("writer") == w
        and comp.get("note") == f"generation {step} by {w}"
        and torch.equal(comp.get("t"), torch.arange(4, dtype=torch.float64) * step)
    )


def quiet_store(folder: Path, **kw) -> CheckpointStore:
    return CheckpointStore(folder, writer=False, **kw)


def latest_valid_quietly(store: CheckpointStore, *, deep: bool = True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        return store.latest_valid(deep=deep)


@dataclass
class Verdict:
    """Outcome of one recovery: whether it survived, and if not, why (data lost or damage trusted)."""

    ok: bool
    step: int | None = None
    why: str = ""


def recover_and_check(folder: Path, n: int, *, floor: int | None, newest_possible: int,
                      key: bytes | None = None, exact: int | None = None) -> Verdict:
    """The reader's view of a run folder after a fault.

    Survives when: the newest valid generation exists, is >= ``floor`` (the
    newest generation that was durably committed before the fault) and <=
    ``newest_possible``, equals ``exact`` when given, loads bitwise equal to
    what was saved; and *every* generation the deep check calls valid loads
    bitwise equal too (a damaged generation is never trusted). With ``key``,
    the same holds under ``require_signature``.
    """
    try:
        store = quiet_store(folder, require_signature=key is not None, hmac_key=key)
        g = latest_valid_quietly(store)
        if g is None:
            return Verdict(floor is None, None, "no valid generation")
        if floor is not None and g.step < floor:
            return Verdict(False, g.step, f"rolled back below the durable generation {floor}")
        if g.step > newest_possible:
            return Verdict(False, g.step, "a generation newer than any saved")
        if exact is not None and g.step != exact:
            return Verdict(False, g.step, f"expected generation {exact}")
        for gen in store.generations(deep=True):
            if not gen.valid:
                continue
            contents, comp = store.load(gen.step, expected_n=n)
            if not generation_matches(contents, comp, gen.step, n):
                return Verdict(False, g.step, f"generation {gen.step} passed its checks but differs from what was saved")
        return Verdict(True, g.step)
    except Exception as exc:  # a reader that crashes on a fault is a failure too
        return Verdict(False, None, f"{type(exc).__name__}: {exc}"[:400])


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if fsio.is_temp_name(p.name))


# ---------------------------------------------------------------- forked children

def in_child(fn: Callable[..., Any], *args: Any) -> int:
    """Run ``fn(*args)`` in a forked child; return its exit code, or ``-signal`` if killed.

    The child inherits the imported torch (no 3 s interpreter start per
    case) and leaves with ``os._exit`` (no pytest teardown). An exception in
    the child prints its traceback and exits 3.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            warnings.simplefilter("ignore")
            fn(*args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 3
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def reset_ops() -> None:
    """No hook, recorder or byte budget (every test starts and ends clean)."""
    fsio.ops.hook = None
    fsio.ops.after_hook = None
    fsio.ops.recorder = None
    fsio.ops.byte_budget = None
    fsio.ops.on_budget_spent = None


# ---------------------------------------------------------------- the ledger

@dataclass
class Tally:
    """Cases of one fault family: tried, survived, data lost, with the first failures."""

    family: str
    what: str = ""
    cases: int = 0
    survived: int = 0
    lost: int = 0
    failures: list[str] = field(default_factory=list)
    detail: str = ""
    _recorded: bool = False

    def add(self, ok: bool, label: str = "", why: str = "") -> bool:
        self.cases += 1
        if ok:
            self.survived += 1
        else:
            self.lost += 1
            if len(self.failures) < 20:
                self.failures.append(f"{label}: {why}")
        return ok

    def record(self) -> None:
        """Append to the ledger (if ``make test-faults`` set one)."""
        path = os.environ.get(LEDGER_ENV)
        if not path or self._recorded:
            return
        self._recorded = True
        line = json.dumps({"family": self.family, "what": self.what, "cases": self.cases,
                           "survived": self.survived, "lost": self.lost, "failures": self.failures,
                           "detail": self.detail, "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                           "full": FULL})
        with open(path, "a") as f:
            f.write(line + "\n")

    def check(self) -> None:
        """Record, then fail the test if anything was lost."""
        self.record()
        assert self.cases > 0, f"{self.family}: no case ran"
        assert self.lost == 0, f"{self.family}: {self.lost}/{self.cases} lost:\n" + "\n".join(self.failures)


def spread(rnd: random.Random, lo: int, hi: int, k: int, must: Iterable[int] = ()) -> list[int]:
    """``k`` distinct ints in ``[lo, hi)`` (all of them if fewer), plus ``must``."""
    span = range(lo, hi)
    chosen = set(must) | (set(span) if len(span) <= k else set(rnd.sample(span, k)))
    return sorted(x for x in chosen if lo <= x < hi)


# ---------------------------------------------------------------- a checkpoint.pt state

def tiny_pt_state(steps: int = 2) -> dict[str, Any]:
    """A valid ``checkpoint.pt`` state: a tiny model + AdamW after ``steps`` updates."""
    import ripresa

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    state = ripresa.TrainingState(model=model, optimizer=opt, config={"tiny": True})
    return state.snapshot(ripresa.Progress(step=steps))


def same_tree(a: Any, b: Any) -> bool:
    """Bitwise equality of two state trees (tensors: dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(_bits(a), _bits(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat if t.dtype == torch.bool else flat.view(torch.uint8)
