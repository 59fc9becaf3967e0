"""Shared helpers: the repository root, running the CLI and scripts in real subprocesses."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
TRAIN = EXAMPLES / "regression" / "train.py"


def run(argv: list[str], *, cwd: Path | None = None, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command in a fresh process; capture text output."""
    full_env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", COLUMNS="200")
    if env:
        full_env.update(env)
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


def ripresa_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "ripresa", *map(str, args)], **kw)


def train(*args: str, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-B", str(TRAIN), *map(str, args)], **kw)


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (to prove nothing was changed)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="session")
def interrupted_run(tmp_path_factory) -> Path:
    """A real 5-step run of the reference exercise (checkpoint at the cut)."""
    out = tmp_path_factory.mktemp("exercise") / "interrupted"
    res = train("--steps", "5", "--output", out)
    assert res.returncode == 0, res.stderr
    return out


def popen(argv: list[str]) -> subprocess.Popen:
    """A child process with piped text output (for signal and kill tests)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def ripresa_train_proc(*args: str) -> subprocess.Popen:
    """`ripresa train ARGS` as a child process."""
    return popen([sys.executable, "-m", "ripresa", "train", *map(str, args)])


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    """Wait until the run's history has reached ``step`` (the child must stay alive)."""
    from ripresa.store.history import read_history

    hist = run / ".loss.jsonl"
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        if hist.exists():
            steps = read_history(hist).steps
            if steps and max(steps) >= step:
                return max(steps)
        time.sleep(0.05)
    raise AssertionError(f"timeout waiting for step {step} in {run}")


def valid_steps(run: Path) -> list[int]:
    """Steps of the committed, valid generations of a run folder (ANDREA .bin and general .safetensors alike)."""
    from ripresa.store.backend import backend_of
    from ripresa.store.store import CheckpointStore

    store = CheckpointStore(run, writer=False)
    return sorted({g.step for kind in ("bin", "st") for g in backend_of(kind, store).generations() if g.valid})


def generation_file(run: Path, step: int) -> Path:
    """The main file of generation ``step``, of either kind: ``step_N.bin`` or ``step_N.safetensors``."""
    found = [p for p in (run / f"step_{step:06d}.bin", run / f"step_{step:06d}.safetensors") if p.exists()]
    assert len(found) == 1, f"generation {step} of {run}: {found}"
    return found[0]


#: Streams a script that never seeds them starts from the OS's entropy in each process: not compared.
_UNSEEDED = ("rng/python/", "rng/numpy_legacy/")


def same_generation(a: Path, b: Path, step: int) -> bool:
    """Generation ``step`` of run folders ``a`` and ``b`` holds the same state, bit for bit: step, weights, m and v
    of a .bin; every tensor of a general generation (model, any optimizer state, buffers, torch's random streams),
    but for Python's ``random`` and NumPy's global streams (:data:`_UNSEEDED`)."""
    fa, fb = generation_file(a, step), generation_file(b, step)
    if fa.name != fb.name:
        return False
    if fa.suffix == ".bin":
        return fa.read_bytes() == fb.read_bytes()
    import torch

    from ripresa.formats import safetensors_file as st

    ta, tb = st.read(fa)[1], st.read(fb)[1]
    keys = {k for k in ta.keys() | tb.keys() if not k.startswith(_UNSEEDED)}
    return all(k in ta and k in tb and ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape
               and torch.equal(ta[k], tb[k]) for k in keys)


def ranks_of(launcher_pid: int) -> dict[int, int]:
    """``{rank: pid}`` of the workers a torchrun launcher started (from /proc)."""
    kids: set[int] = set()
    for tid in os.listdir(f"/proc/{launcher_pid}/task"):
        try:
            kids.update(int(x) for x in Path(f"/proc/{launcher_pid}/task/{tid}/children").read_text().split())
        except OSError:
            pass
    out = {}
    for pid in kids:
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = pid
    return out


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    """A launched process group's output; on a timeout the whole group is killed."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


# ------------------------------------------------------------------- shared fixtures (tests/README.md)


@pytest.fixture
def tiny():
    """The shared tiny state (tests/support/tiny.py): ``nn.Linear(4, 3)``, AdamW, StepLR, seed 0."""
    from support.tiny import tiny_state

    return tiny_state(scheduler=(2, 0.5), config={"tiny": True})


@pytest.fixture
def clean_fault_ops():
    """No fault hook, recorder or byte budget before and after the test (tests/faults/common.py: ``reset_ops``).
    Use it with ``pytestmark = pytest.mark.usefixtures("clean_fault_ops")``."""
    from faults.common import reset_ops

    reset_ops()
    yield
    reset_ops()


@pytest.fixture
def no_hmac_env(monkeypatch):
    """No HMAC key, key file or signature requirement in the environment (docs/FORMAT.md, signing)."""
    from ripresa.io import auth

    for var in (auth.ENV_KEY, auth.ENV_KEY_FILE, auth.ENV_REQUIRE):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(autouse=True)
def _no_verify_steering_left():
    """A test that steers a Checkpointer in pytest's own process (RIPRESA_VERIFY) leaves no steering behind:
    every later session of a steered process is steered too (docs/VERIFY.md)."""
    yield
    steer = sys.modules.get("ripresa.session.steer")
    if steer is not None and hasattr(steer, "forget"):
        steer.forget()


@pytest.fixture
def one_thread():
    """torch on one thread for the test: tiny models run fastest so; two OpenMP threads on a busy 2-core box spin."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
