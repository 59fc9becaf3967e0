"""The memory tier (``Checkpointer(memory_every=k)``; docs/TIERS.md).

Real processes and real SIGKILLs (tests/fixtures/gpu_loop.py on the CPU), the tier's real
folder under ``/dev/shm`` (or, where a test makes that folder hostile, under its own
``RIPRESA_MEMORY_DIR``), tolerance 0.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES

import ripresa
from ripresa.session.memory import MemoryTierWarning
from ripresa.store import memory as mem

LOOP = FIXTURES / "gpu_loop.py"
ARGS = ("--device", "cpu", "--steps", "20", "--every", "8", "--memory-every", "1")


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", **extra)


def _loop(run: Path, *args: str, env: dict[str, str] | None = None, rc: int = 0) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-B", str(LOOP), "--run", str(run), *ARGS, *map(str, args)],
                         capture_output=True, text=True, timeout=300, env=env or _env())
    assert res.returncode == rc, (res.returncode, res.stdout[-2000:], res.stderr[-4000:])
    return res


def _final(run: Path) -> dict:
    return json.loads((run / "final.rank0.json").read_text())


def _history(run: Path) -> list[dict]:
    out = []
    for line in (run / ".loss.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _events(run: Path, name: str) -> list[dict]:
    return [r for r in _history(run) if r.get("event") == name]


def _losses(run: Path) -> dict[int, float]:
    """The last recorded loss of every step (a redone step's line is written again)."""
    return {r["step"]: r["loss"] for r in _history(run) if "event" not in r and "step" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    ref = tmp_path_factory.mktemp("memory") / "ref"
    _loop(ref)
    assert not mem.tier_folder(ref).exists()  # a normal end removes the tier's folder
    return ref


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[Path, int]:
    """A run SIGKILLed at the end of a random step between its disk generations (8 and 16), the tier left behind."""
    run = tmp_path_factory.mktemp("memory") / "killed"
    kill_at = random.randint(10, 15)  # at 9 the capture of 9 may be in flight: memory holds 8, the disk too
    _loop(run, "--kill-at", str(kill_at), "--sync", rc=-signal.SIGKILL)  # step 8 surely committed on disk
    assert max(_losses(run)) == kill_at
    yield run, kill_at
    mem.discard(run)


def _copy_killed(killed: tuple[Path, int], dest: Path) -> Path:
    """The killed run under another path, with its memory folder moved along (the folder is keyed by the path)."""
    src, _ = killed
    shutil.copytree(src, dest)
    shutil.copytree(mem.tier_folder(src), mem.tier_folder(dest))
    return dest


def test_a_run_sigkilled_between_disk_generations_resumes_from_memory_with_at_most_one_step_redone(
        reference, killed, tmp_path):
    run = _copy_killed(killed, tmp_path / "run")
    kill_at = killed[1]
    _loop(run)
    (ev,) = _events(run, "memory_resume")
    assert ev["newest_disk"] == 8 and kill_at - 1 <= ev["step"] <= kill_at, (ev, kill_at)  # at most one step redone
    (res,) = _events(run, "resume")
    assert res["from_step"] == ev["step"]
    a, b = _final(reference), _final(run)
    assert b["state"] == a["state"] and b["rng"] == a["rng"]  # weights, moments, streams: bitwise
    assert _losses(run) == _losses(reference)  # every step's loss, the redone one included
    assert not mem.tier_folder(run).exists()  # removed at the normal end
    assert not _events(run, "other_mode_generation")  # a promoted generation is announced as memory_resume only


def test_disk_generations_keep_their_own_cadence(reference):
    steps = sorted(int(p.name[5:11]) for p in reference.glob("step_*.safetensors"))
    assert steps == [8, 16, 20]  # every 8, and the final save: none of the memory tier's steps
    assert not _events(reference, "memory_resume") and not _events(reference, "memory_tier_off")


#: Tampering that touches every slot: no memory generation may be used. The others damage the newest slot only:
#: the older one, intact, may be (when it is newer than the disk).
EVERY_SLOT = ("reboot", "other-run", "other-user", "marker-symlink", "marker-fifo")


def _tamper(run: Path, how: str) -> int:
    """Damage the killed run's memory generations as ``how`` says; the newest one's step."""
    folder = mem.tier_folder(run)
    marks = sorted(folder.glob("slot*.marker"), key=lambda p: json.loads(p.read_text())["step"])
    newest = marks[-1]
    step = json.loads(newest.read_text())["step"]
    slot = newest.with_suffix(".safetensors")
    for m in marks:
        doc = json.loads(m.read_text())
        if how == "reboot":
            doc["boot_id"] = "00000000-0000-0000-0000-000000000000"
        elif how == "other-user":
            doc["uid"] = os.geteuid() + 4242
        elif how == "marker-symlink":
            m.unlink()
            m.symlink_to("/etc/passwd")
            continue
        elif how == "marker-fifo":
            m.unlink()
            os.mkfifo(m)
            continue
        else:
            continue
        m.write_text(json.dumps(doc))
    if how == "other-run":
        (run / mem.TOKEN_NAME).write_text("0" * 32 + "\n")
    elif how == "flipped":
        with open(slot, "r+b") as f:
            f.seek(slot.stat().st_size - 3)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
    elif how == "truncated":
        os.truncate(slot, slot.stat().st_size // 2)
    elif how == "huge-step":
        doc = json.loads(newest.read_text())
        doc["step"] = 10**30
        newest.write_text(json.dumps(doc))
    elif how == "garbage":
        newest.write_bytes(b"\x00\xff{" * 1000)
    elif how == "companion":
        comp = newest.with_suffix(".json")
        comp.write_text(comp.read_text().replace('"step"', '"step" ', 1))
    return step


HOWS = ["reboot", "other-run", "other-user", "flipped", "truncated", "marker-symlink", "marker-fifo", "huge-step",
        "garbage", "companion"]


@pytest.mark.parametrize("how", HOWS)
def test_a_memory_generation_that_cannot_be_trusted_is_not_read_back(killed, tmp_path, how):
    """Across a reboot, of another run or user, damaged, or a hostile marker: never returned, one note saying
    why; only an older, intact slot may be (nothing hangs on the FIFO, nothing outside is followed)."""
    run = _copy_killed(killed, tmp_path / "run")
    newest = _tamper(run, how)
    found, notes = mem.newest(run, above=8)
    if how in EVERY_SLOT:
        assert found is None
    else:
        assert found is None or found.step < newest
    assert notes and all("memory" in n for n in notes), notes
    mem.discard(run)


@pytest.mark.parametrize("how", ["reboot", *(pytest.param(h, marks=pytest.mark.slow) for h in HOWS if h != "reboot")])
def test_a_run_whose_memory_generation_cannot_be_trusted_resumes_from_the_disk_and_ends_bitwise(
        reference, killed, tmp_path, how):
    """End to end: a warning line and an older generation, no traceback, and the run still ends bitwise equal."""
    run = _copy_killed(killed, tmp_path / "run")
    newest = _tamper(run, how)
    res = _loop(run)
    assert "Traceback" not in res.stderr
    resumed = _events(run, "memory_resume")
    if how in EVERY_SLOT:
        assert resumed == [] and _events(run, "resume")[0]["from_step"] == 8
    else:
        assert all(ev["step"] < newest for ev in resumed), (resumed, newest)
    assert _events(run, "memory_generation_skipped") and "warning: memory" in res.stderr, res.stderr[-2000:]
    assert _final(run)["state"] == _final(reference)["state"]
    assert Path("/etc/passwd").exists()


# ---------------------------------------------------------------------- in one process
def _state(big: int = 0) -> ripresa.TrainingState:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1)]
    if big:
        layers.insert(0, torch.nn.Linear(8, 8))
        layers[0].register_parameter("big", torch.nn.Parameter(torch.randn(big)))
    model = torch.nn.Sequential(*layers)
    return ripresa.TrainingState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


def _step(state: ripresa.TrainingState) -> None:
    x = torch.randn(32, 8)
    out = state.model(x)
    loss = ((out - x.sum(1, keepdim=True)) ** 2).mean()
    if hasattr(state.model[0], "big"):
        loss = loss + (state.model[0].big ** 2).mean()
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()


def test_the_memory_generation_holds_its_step_even_when_the_next_optimizer_step_follows_at_once(tmp_path):
    """The copy runs while the loop goes on; the optimizer's step waits for it: the slot equals step N's state,
    BatchNorm's running statistics (changed by the next forward) included."""
    state = _state(big=6_000_000)
    with ripresa.Checkpointer(tmp_path / "run", state, every=0, memory_every=1, handle_signals=False) as ck:
        ck.resume()
        for step in (1, 2, 3):
            _step(state)
            want = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
            moments = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(state.optimizer.state.values())}
            ck.step_done(step)
            _step(state)  # at once: forward, backward and the optimizer's step while the copy may still run
            assert ck.memory is not None and ck.memory.tier is not None
            ck.memory.tier.settle()
            found, notes = mem.newest(tmp_path / "run", above=None)
            assert found is not None and not notes and found.step == step
            got = dict(found.ordered)
            for k, v in want.items():
                assert torch.equal(got[f"model/{k}"].view(v.dtype).view(v.shape), v), k
            for i, per in moments.items():
                for k, v in per.items():
                    key = f"optimizer/state/{i}/{k}"
                    assert torch.equal(got[key].view(v.dtype).view(v.shape), v), key
    assert not mem.tier_folder(tmp_path / "run").exists()


def test_an_error_path_keeps_the_memory_generation_and_the_next_start_resumes_from_it(tmp_path):
    run = tmp_path / "run"
    state = _state()
    with pytest.raises(RuntimeError, match="crash"):
        with ripresa.Checkpointer(run, state, every=100, memory_every=2, handle_signals=False) as ck:
            ck.resume()
            for step in range(1, 6):
                _step(state)
                ck.step_done(step)
            raise RuntimeError("crash")
    assert mem.tier_folder(run).is_dir()  # kept: the error path may be a crash the next start recovers from
    weights = {k: v.clone() for k, v in state.model.state_dict().items()}
    state2 = _state()
    with ripresa.Checkpointer(run, state2, every=100, memory_every=2, handle_signals=False) as ck:
        assert ck.resume() == 4  # memory_every=2: step 4 is the newest memory generation; nothing on disk
        assert ck.resumed_from is not None and ck.resumed_from.path.name == "step_000004.safetensors"
    assert not all(torch.equal(weights[k], state2.model.state_dict()[k]) for k in weights)  # step 5 is not step 4
    assert not mem.tier_folder(run).exists()


def test_a_resume_from_a_named_generation_or_a_fresh_start_forgets_the_memory_generations(tmp_path):
    run = tmp_path / "run"
    state = _state()
    with pytest.raises(RuntimeError):
        with ripresa.Checkpointer(run, state, every=2, memory_every=1, handle_signals=False) as ck:
            ck.resume()
            for step in range(1, 4):
                _step(state)
                ck.step_done(step)
            raise RuntimeError("crash")
    found, _ = mem.newest(run, above=2)
    assert found is not None and found.step == 3
    with ripresa.Checkpointer(run, _state(), every=2, memory_every=1, handle_signals=False) as ck:
        assert ck.resume(from_path=run / "step_000002.safetensors") == 2
        assert mem.newest(run, above=None)[0] is None  # another past: the memory generation of step 3 is gone
        ck.close(final_save=False)


def test_a_tier_folder_of_another_user_turns_the_tier_off_and_the_disk_tier_goes_on(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    theirs = shm / f"ripresa-{os.geteuid()}"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, os.geteuid() + 4242, -1)  # as a planted folder would be (root in this sandbox may chown)
    if theirs.stat().st_uid == os.geteuid():
        pytest.skip("cannot give a folder to another user here")
    os.environ[mem.MEMORY_ENV] = str(shm)
    try:
        state = _state()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with ripresa.Checkpointer(tmp_path / "run", state, every=2, memory_every=1, handle_signals=False) as ck:
                ck.resume()
                for step in range(1, 5):
                    _step(state)
                    ck.step_done(step)
        msgs = [str(w.message) for w in seen if issubclass(w.category, MemoryTierWarning)]
        assert len(msgs) == 1 and "not a private folder of this user" in msgs[0], msgs
        assert list(theirs.iterdir()) == []  # nothing written into it
        assert _events(tmp_path / "run", "memory_tier_off")
        assert (tmp_path / "run" / "step_000004.safetensors").exists()
    finally:
        del os.environ[mem.MEMORY_ENV]


def test_too_little_shared_memory_is_refused_before_the_first_capture(tmp_path):
    os.environ[mem.MEMORY_ENV] = str(tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    try:
        (tmp_path / "run").mkdir()
        tier = mem.MemoryTier(tmp_path / "run")
        vfs = os.statvfs(tier.folder)
        with pytest.raises(mem.MemoryUnusable, match="too little shared memory") as exc:
            tier.check_room(vfs.f_bavail * vfs.f_frsize // 2)  # two slots of half the free space, and a margin
        assert "disk tier goes on" in str(exc.value) and "other run folder" not in str(exc.value)
        stale = mem.tier_folder(tmp_path / "gone")  # a run killed and never started again
        stale.mkdir(mode=0o700)
        (stale / "slot0.safetensors").write_bytes(b"x" * 4096)
        with pytest.raises(mem.MemoryUnusable) as exc:
            tier.check_room(vfs.f_bavail * vfs.f_frsize // 2)
        assert "of 1 other run folder(s)" in str(exc.value), str(exc.value)
        tier.check_room(1024)
        tier.close(remove=True)
    finally:
        del os.environ[mem.MEMORY_ENV]


@pytest.mark.slow
def test_a_run_killed_from_outside_at_a_random_moment_redoes_at_most_one_step(reference, tmp_path):
    """SIGKILL at any moment of a step (inside it, during a copy or a hash, during a disk save), again and again:
    each start resumes at most one step behind the last step the killed process completed."""
    run = tmp_path / "run"
    last = 0
    for _ in range(5):
        n = len(_events(run, "resume")) if (run / ".loss.jsonl").exists() else 0
        proc = subprocess.Popen([sys.executable, "-B", str(LOOP), "--run", str(run), *ARGS, "--sleep", "0.02"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
        target = min(last + random.randint(2, 5), 19)
        t0 = time.monotonic()
        while not (run / ".loss.jsonl").exists() or max(_losses(run), default=0) < target:
            assert proc.poll() is None and time.monotonic() - t0 < 120
            time.sleep(0.01)
        time.sleep(random.uniform(0, 0.03))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        resumed = _events(run, "resume")[n:]
        if n or resumed:
            assert resumed and resumed[0]["from_step"] >= last - 1, (resumed, last)
        last = max(_losses(run))
        if last >= 19:
            break
    _loop(run)
    assert _events(run, "resume")[-1]["from_step"] >= last - 1
    assert _final(run)["state"] == _final(reference)["state"]


def test_inspect_shows_the_memory_generation_a_start_would_resume_from(killed, tmp_path, capsys):
    from ripresa.cli import main

    run = _copy_killed(killed, tmp_path / "run")
    assert main(["inspect", str(run), "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["run"]["memory"]
    steps = [m["step"] for m in memory["generations"] if m["usable"]]
    assert steps and max(steps) >= killed[1] - 1 and memory["folder"] == str(mem.tier_folder(run))
    _tamper(run, "reboot")
    assert main(["inspect", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "not usable" in out and "reboot" in out, out
    mem.discard(run)


def test_steps_shorter_than_the_hash_wait_for_it_so_every_capture_is_committed(tmp_path):
    """Steps much shorter than hashing the state: each due capture waits for the previous one before the step's
    history line, so a kill after any line finds the step before it in memory; every generation is whole."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5000, 5000, bias=False)  # 100 MB: hashing it takes longer than these steps
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ripresa.TrainingState(model=model, optimizer=opt)
    w0 = model.weight.detach().clone()
    run = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with ripresa.Checkpointer(run, state, every=0, memory_every=1, handle_signals=False) as ck:
            ck.resume()
            for step in range(1, 7):
                with torch.no_grad():
                    model.weight.grad = torch.ones_like(model.weight)
                opt.step()
                ck.step_done(step)
                found, notes = mem.newest(run, above=None)
                assert found is not None and not notes and found.step == step - 1 if step > 1 else True
            assert ck.memory is not None and ck.memory.captures == 6
            raise RuntimeError("crash")  # an error path: the memory generation is kept
    found, notes = mem.newest(run, above=None)
    assert found is not None and not notes and found.step == 6
    want = w0
    for _ in range(found.step):  # the weight of that very step: SGD's update, repeated
        want = want.add(torch.ones_like(want), alpha=-0.1)
    got = dict(found.ordered)["model/weight"].view(torch.float32).view(5000, 5000)
    assert torch.equal(got, want)
    assert _events(run, "memory_tier")[0]["captures"] == 6
    mem.discard(run)
