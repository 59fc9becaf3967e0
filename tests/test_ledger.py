"""The batch-inference ledger: real runs, real SIGKILLs, exactly once.

A tiny run folder is trained once (two generations, steps 10 and 20). The
reference ledger is written by a ``python -m ripresa.engine.ledger`` process. The
killed jobs are real processes too, forked by a small fork server ("zygote")
that has imported torch once: each child runs ``ripresa.engine.ledger.main`` with one
torch thread, opens and locks the ledger itself, and is killed with a real
SIGKILL — only the 1-2 s of torch start-up per kill is saved, which keeps 20+
kills inside the time budget on a busy 2-core box. The test knobs ``--sleep``
(seconds per item, half before and half after the record is written) and
``--trace`` (one line per *generated* item, written before its record) make
the kills land mid-job and let the tests count generations.
"""

from __future__ import annotations

import errno
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.ripresa_faults import fault_env

from ripresa.errors import BadInput, IntegrityError, LockHeld, SaveFailed

PY = sys.executable
N_INPUTS = 40
TOKENS = "8"
ENV = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
ENV.pop("RIPRESA_CRASH_AT", None)


# ---- fixtures and helpers ------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ledger") / "run"
    res = subprocess.run(
        [PY, "-m", "ripresa", "train", "--run", str(run), "--config", "tiny", "--quiet", "--threads", "1",
         "--set", "train.batch_size=4", "--steps", "20", "--every", "10", "--no-audit"],
        capture_output=True, text=True, timeout=120, env=ENV,
    )
    assert res.returncode == 0, res.stderr
    assert (run / "step_000010.bin").is_file() and (run / "step_000020.bin").is_file()
    return run


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    lines = []
    for i in range(1, N_INPUTS + 1):
        if i == 7:
            lines.append("")  # an empty line is an input too
        elif i == 13:
            lines.append("x" * 100 + " longer than the model's 64-byte context")
        else:
            lines.append(["def ", "The ", "import ", "class Simple", "è già "][i % 5] + f"item {i}")
    path = tmp_path_factory.mktemp("inputs") / "prompts.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def child_argv(run: Path, inputs: Path, out: Path, *extra: str) -> list[str]:
    return [PY, "-m", "ripresa.engine.ledger", str(run), "--inputs", str(inputs), "--out", str(out),
            "--max-new-tokens", TOKENS, "--threads", "1", "--quiet", *extra]


def run_main(capsys, run: Path, inputs: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    """The same entry point in this process (no torch start-up): (exit code, stdout, stderr)."""
    from ripresa.engine.ledger import main

    code = main([str(a) for a in child_argv(run, inputs, out, *extra)[3:]])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def complete_records(out: Path) -> list[dict]:
    """Records on complete lines only (what a reader may trust)."""
    data = out.read_bytes() if out.exists() else b""
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]


def trace_ids(trace: Path, start: int = 0) -> list[int]:
    """Ids generated (one trace line each, written before the record) from byte ``start`` on."""
    data = trace.read_bytes()[start:] if trace.exists() else b""
    return [int(line.split()[1]) for line in data.splitlines()]


def trace_size(trace: Path) -> int:
    return trace.stat().st_size if trace.exists() else 0


def assert_exactly_once_and_equal(out: Path, reference: dict[int, str]) -> None:
    recs = complete_records(out)
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)), f"duplicate ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    assert sorted(ids) == list(range(1, N_INPUTS + 1))
    assert out.read_bytes().endswith(b"\n")
    assert {r["id"]: r["completion"] for r in recs} == reference


ZYGOTE = r"""
import json, os, sys
import torch
torch.set_num_threads(1)
import ripresa.engine.ledger
from ripresa_faults import install_from_env
for line in sys.stdin:
    cmd = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            for fd, path in ((1, cmd["stdout"]), (2, cmd["stderr"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            os.environ.update(cmd["env"])
            install_from_env()  # RIPRESA_CRASH_AT, as sitecustomize reads it in a fresh process
            code = ripresa.engine.ledger.main(cmd["argv"])
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class Child:
    """One job forked by the zygote: a real process with its own pid, stdout and stderr files."""

    def __init__(self, zygote: subprocess.Popen, pid: int, stdout: Path, stderr: Path) -> None:
        self.zygote, self.pid, self.stdout, self.stderr = zygote, pid, stdout, stderr
        self.rc: int | None = None

    def _poll_rc(self, timeout: float) -> int | None:
        if self.rc is None:
            assert self.zygote.stdout is not None
            if select.select([self.zygote.stdout], [], [], timeout)[0]:
                line = self.zygote.stdout.readline()
                assert line, "the zygote died"
                self.rc = json.loads(line)["rc"]
        return self.rc

    def wait_started(self, timeout: float = 60.0) -> None:
        """Until the start line (model loaded, ledger locked and read) is on the child's stderr."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.stderr.read_text(errors="replace") if self.stderr.exists() else ""
            if "ripresa generate:" in text and text.endswith("\n"):
                return
            if self._poll_rc(0.01) is not None:
                raise AssertionError(f"child exited (rc {self.rc}) before starting: {text!r}")
            assert time.monotonic() < deadline, f"child did not start in {timeout} s: {text!r}"

    def kill(self) -> None:
        if self.rc is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float = 120.0) -> int:
        rc = self._poll_rc(timeout)
        assert rc is not None, f"child {self.pid} still running after {timeout} s"
        return rc

    def err(self) -> str:
        return self.stderr.read_text(errors="replace")

    def report(self) -> dict:
        return json.loads(self.stdout.read_text())


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """``spawn(run, inputs, out, *extra, env=...) -> Child``: a forked ``ripresa.engine.ledger.main``."""
    folder = tmp_path_factory.mktemp("zygote")
    proc = subprocess.Popen([PY, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=dict(ENV, **fault_env()), text=True, bufsize=1)
    count = [0]

    def spawn(run: Path, inputs: Path, out: Path, *extra: str, env: dict | None = None) -> Child:
        count[0] += 1
        stdout, stderr = folder / f"{count[0]}.out", folder / f"{count[0]}.err"
        cmd = {"argv": child_argv(run, inputs, out, *extra)[3:], "env": env or {},
               "stdout": str(stdout), "stderr": str(stderr)}
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(cmd) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, "the zygote died"
        return Child(proc, json.loads(line)["pid"], stdout, stderr)

    yield spawn
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def reference(run_dir, inputs, tmp_path_factory) -> tuple[Path, dict[int, str]]:
    """An uninterrupted run: the ledger every interrupted job must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "ref.jsonl"
    res = subprocess.run(child_argv(run_dir, inputs, out), capture_output=True, text=True, timeout=120, env=ENV)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["total"] == N_INPUTS and report["generated_now"] == N_INPUTS and report["already_done"] == 0
    assert report["step"] == 20  # the newest valid generation
    recs = complete_records(out)
    assert [r["id"] for r in recs] == list(range(1, N_INPUTS + 1))
    for r in recs:
        assert list(r) == ["id", "input_sha256", "prompt", "completion", "step"]
        assert r["step"] == 20
    return out, {r["id"]: r["completion"] for r in recs}


@pytest.fixture(scope="module")
def in_process_torch():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float path as the children's
    yield
    torch.set_num_threads(before)


def copy_ledger(src: Path, dst: Path) -> Path:
    shutil.copyfile(src, dst)
    shutil.copyfile(src.with_name(src.name + ".meta.json"), dst.with_name(dst.name + ".meta.json"))
    return dst


# ---- the kills ---------------------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_at_random_moments_then_complete(run_dir, inputs, reference, tmp_path, zygote):
    """>= 20 SIGKILLs mid-job, then a run to completion: every id exactly once, the same
    completions as the uninterrupted run, and no completed item ever generated again."""
    ref_out, ref = reference
    out, trace = tmp_path / "out.jsonl", tmp_path / "trace.log"
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    snapshots: list[tuple[int, set[int]]] = [(0, set())]  # (trace size, completed ids) after each kill
    kills = 0
    while kills < 20:
        child = zygote(run_dir, inputs, out, "--sleep", "0.35", "--trace", str(trace))
        try:
            child.wait_started()
            time.sleep(rng.uniform(0.05, 0.6))
        finally:
            child.kill()
        assert child.wait() == -signal.SIGKILL, f"seed {seed}: the job ended before kill {kills + 1}"
        kills += 1
        done = {r["id"] for r in complete_records(out)}
        start, before = snapshots[-1]
        generated = set(trace_ids(trace, start))
        # nothing completed before this process started was generated again ...
        assert not generated & before, f"seed {seed}: recomputed {sorted(generated & before)}"
        # ... and the kill wasted at most the one item in flight
        assert len(generated - done) <= 1, f"seed {seed}: lost {sorted(generated - done)}"
        assert done >= before
        snapshots.append((trace_size(trace), done))
    assert len(snapshots[-1][1]) < N_INPUTS, "every kill must have landed mid-job"

    child = zygote(run_dir, inputs, out, "--trace", str(trace))
    assert child.wait() == 0, child.err()
    report = child.report()
    assert report["already_done"] == len(snapshots[-1][1])
    assert report["already_done"] + report["generated_now"] == N_INPUTS
    final_gen = trace_ids(trace, snapshots[-1][0])
    assert not set(final_gen) & snapshots[-1][1]
    assert len(final_gen) == report["generated_now"]

    assert_exactly_once_and_equal(out, ref)
    # every generation is accounted for: one per item, plus at most one per kill
    assert N_INPUTS <= len(trace_ids(trace)) <= N_INPUTS + kills
    meta = json.loads((tmp_path / "out.jsonl.meta.json").read_text())
    assert meta["binding"] == json.loads(ref_out.with_name(ref_out.name + ".meta.json").read_text())["binding"]


@pytest.mark.slow
def test_crash_at_exact_boundaries(run_dir, inputs, reference, tmp_path, zygote):
    """SIGKILL at chosen system calls (RIPRESA_CRASH_AT): before the meta file is renamed
    into place, between a record's write and its fsync, and after an item was generated
    but before its record was written."""
    _, ref = reference
    out, trace = tmp_path / "out.jsonl", tmp_path / "trace.log"
    meta = tmp_path / "out.jsonl.meta.json"

    # 1. killed before the meta file is published: no meta, an empty ledger, a temporary left
    child = zygote(run_dir, inputs, out, "--trace", str(trace), env=fault_env(crash_at="rename:1"))
    assert child.wait() == -signal.SIGKILL, child.err()
    assert not meta.exists() and out.read_bytes() == b""
    assert any(p.name.startswith(".out.jsonl.meta.json.tmp.") for p in tmp_path.iterdir())

    # 2. fresh again; fsync #1 is the meta's, #2 record 1's, #3 record 2's: killed after
    #    record 2 was written, before its fsync — it is in the file, so it counts as done
    child = zygote(run_dir, inputs, out, "--trace", str(trace), env=fault_env(crash_at="fsync:3"))
    assert child.wait() == -signal.SIGKILL, child.err()
    assert meta.is_file()
    assert not any(".tmp." in p.name for p in tmp_path.iterdir()), "the dead writer's temporary is cleaned"
    assert [r["id"] for r in complete_records(out)] == [1, 2]
    mark = trace_size(trace)

    # 3. resumed (no meta write): write #1 is record 3, write #2 record 4 — killed after
    #    item 4 was generated, before its record was written
    child = zygote(run_dir, inputs, out, "--trace", str(trace), env=fault_env(crash_at="write:2"))
    assert child.wait() == -signal.SIGKILL, child.err()
    assert "2/40 already done" in child.err()
    assert trace_ids(trace, mark) == [3, 4]
    assert [r["id"] for r in complete_records(out)] == [1, 2, 3]
    mark = trace_size(trace)

    # 4. to completion: 1..3 are skipped, 4 (never recorded) is generated again
    child = zygote(run_dir, inputs, out, "--trace", str(trace))
    assert child.wait() == 0, child.err()
    report = child.report()
    assert (report["already_done"], report["generated_now"]) == (3, N_INPUTS - 3)
    assert trace_ids(trace, mark) == list(range(4, N_INPUTS + 1))
    assert_exactly_once_and_equal(out, ref)


@pytest.mark.slow
def test_torn_last_line_is_repaired(run_dir, inputs, reference, tmp_path, in_process_torch, capsys):
    """A last line without its newline (killed mid-write) is cut off, and only it; the job
    then finishes byte-identical to the uninterrupted ledger."""
    ref_out, ref = reference
    full = ref_out.read_bytes()
    lines = full.splitlines(keepends=True)
    out = copy_ledger(ref_out, tmp_path / "out.jsonl")
    torn = b"".join(lines[:10]) + lines[10][: len(lines[10]) // 2]
    out.write_bytes(torn)
    meta_before = (tmp_path / "out.jsonl.meta.json").read_bytes()
    code, stdout, stderr = run_main(capsys, run_dir, inputs, out)
    assert code == 0, stderr
    assert "removed a torn last line" in stderr
    report = json.loads(stdout)
    assert report["repaired_bytes"] == len(lines[10]) // 2
    assert (report["already_done"], report["generated_now"]) == (10, N_INPUTS - 10)
    assert out.read_bytes() == full  # in id order, so byte-identical
    assert (tmp_path / "out.jsonl.meta.json").read_bytes() == meta_before
    assert_exactly_once_and_equal(out, ref)


# ---- refusals -----------------------------------------------------------------------------


@pytest.mark.slow
def test_changed_inputs_refused_exit_2(run_dir, inputs, reference, tmp_path, in_process_torch, capsys):
    ref_out, _ = reference
    out = copy_ledger(ref_out, tmp_path / "out.jsonl")
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:5]))
    before = out.read_bytes()
    edited = tmp_path / "prompts.txt"
    text = inputs.read_text(encoding="utf-8").splitlines()
    text[20] = "an edited prompt"
    edited.write_text("\n".join(text) + "\n", encoding="utf-8")
    code, _, stderr = run_main(capsys, run_dir, edited, out)
    assert code == 2, stderr
    assert "refusing to mix outputs" in stderr and "inputs_sha256" in stderr
    assert out.read_bytes() == before  # a refusal changes nothing


@pytest.mark.slow
def test_changed_step_and_settings_refused(run_dir, inputs, reference, tmp_path, in_process_torch):
    from ripresa.engine.ledger import generate_batch

    ref_out, ref = reference
    out = copy_ledger(ref_out, tmp_path / "out.jsonl")  # bound to step 20 (the latest)
    out.write_bytes(b"".join(out.read_bytes().splitlines(keepends=True)[:5]))
    before = out.read_bytes()
    kw = dict(max_new_tokens=int(TOKENS), show_progress=False)
    with pytest.raises(BadInput) as info:
        generate_batch(run_dir, inputs, out, step=10, **kw)
    assert info.value.exit_code == 2 and "step: ledger 20, now 10" in str(info.value)
    with pytest.raises(BadInput) as info:
        generate_batch(run_dir, inputs, out, max_new_tokens=9, show_progress=False)
    assert "max_new_tokens: ledger 8, now 9" in str(info.value)
    with pytest.raises(BadInput) as info:
        generate_batch(run_dir, inputs, out, temperature=0.5, **kw)
    assert "temperature" in str(info.value)
    assert out.read_bytes() == before

    # a ledger made from step 10: when "latest" has moved on, the hint says --step 10
    out10 = tmp_path / "out10.jsonl"
    rep = generate_batch(run_dir, inputs, out10, step=10, **kw)
    assert rep["step"] == 10 and rep["generated_now"] == N_INPUTS
    assert {r["step"] for r in complete_records(out10)} == {10}
    assert {r["id"]: r["completion"] for r in complete_records(out10)} != ref  # other weights
    with pytest.raises(BadInput) as info:
        generate_batch(run_dir, inputs, out10, **kw)
    assert "pass --step 10" in (info.value.hint or "")
    assert generate_batch(run_dir, inputs, out10, step=10, **kw)["already_done"] == N_INPUTS

    # the same settings continue it (in process, same floats as the children)
    rep = generate_batch(run_dir, inputs, out, **kw)
    assert (rep["already_done"], rep["generated_now"]) == (5, N_INPUTS - 5)
    assert_exactly_once_and_equal(out, ref)


@pytest.mark.slow
def test_concurrent_second_writer_refused(run_dir, inputs, reference, tmp_path, in_process_torch, zygote):
    from ripresa.engine.ledger import generate_batch

    _, ref = reference
    out = tmp_path / "out.jsonl"
    child = zygote(run_dir, inputs, out, "--sleep", "1.0")
    try:
        child.wait_started()
        with pytest.raises(LockHeld) as info:
            generate_batch(run_dir, inputs, out, max_new_tokens=int(TOKENS), show_progress=False)
        assert info.value.exit_code == 2 and "another process" in info.value.message
    finally:
        child.kill()
    assert child.wait() == -signal.SIGKILL
    # the kernel dropped the dead writer's lock: the job continues here
    rep = generate_batch(run_dir, inputs, out, max_new_tokens=int(TOKENS), show_progress=False)
    assert rep["already_done"] + rep["generated_now"] == N_INPUTS
    assert_exactly_once_and_equal(out, ref)


# ---- a damaged ledger is never "fixed" silently ------------------------------------------------


@pytest.mark.slow
def test_duplicate_id_is_an_integrity_error(run_dir, inputs, reference, tmp_path, in_process_torch):
    from ripresa.engine.ledger import generate_batch

    ref_out, _ = reference
    out = copy_ledger(ref_out, tmp_path / "out.jsonl")
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:6]) + lines[2])
    before = out.read_bytes()
    with pytest.raises(IntegrityError) as info:
        generate_batch(run_dir, inputs, out, max_new_tokens=int(TOKENS), show_progress=False)
    assert info.value.exit_code == 1 and "duplicate id 3" in info.value.message
    assert out.read_bytes() == before

    # a complete line that is not a record (not a torn tail: it ends with a newline)
    out.write_bytes(b"".join(lines[:3]) + b'{"id": 4, "oops": 1}\n')
    with pytest.raises(IntegrityError, match="not a ledger record"):
        generate_batch(run_dir, inputs, out, max_new_tokens=int(TOKENS), show_progress=False)
    # records without the meta file that says what made them
    out.write_bytes(b"".join(lines[:3]))
    (tmp_path / "out.jsonl.meta.json").unlink()
    with pytest.raises(BadInput, match="no meta file"):
        generate_batch(run_dir, inputs, out, max_new_tokens=int(TOKENS), show_progress=False)
    assert out.read_bytes() == b"".join(lines[:3])


@pytest.mark.slow
def test_failed_fsync_removes_its_record(run_dir, inputs, reference, tmp_path, in_process_torch):
    """A record whose fsync failed is taken out again (its durability is unknown) and the
    job stops; the next start redoes exactly that item."""
    from ripresa.engine.ledger import generate_batch
    from ripresa.io import fsio

    _, ref = reference
    out = tmp_path / "out.jsonl"
    calls = {"fsync": 0}

    def hook(op: str, path: str) -> None:
        if op == "fsync" and path == str(out):
            calls["fsync"] += 1
            if calls["fsync"] == 4:
                raise OSError(errno.EIO, "Input/output error")

    fsio.ops.hook = hook
    try:
        with pytest.raises(SaveFailed) as info:
            generate_batch(run_dir, inputs, out, max_new_tokens=int(TOKENS), show_progress=False)
    finally:
        fsio.ops.hook = None
    assert "EIO" in str(info.value.found)
    assert [r["id"] for r in complete_records(out)] == [1, 2, 3]
    assert out.read_bytes().endswith(b"\n")
    rep = generate_batch(run_dir, inputs, out, max_new_tokens=int(TOKENS), show_progress=False)
    assert (rep["already_done"], rep["generated_now"]) == (3, N_INPUTS - 3)
    assert_exactly_once_and_equal(out, ref)


# ---- inputs and seeds ---------------------------------------------------------------------------


def test_read_inputs_and_item_seed(tmp_path):
    from ripresa.engine.ledger import item_seed, read_inputs

    p = tmp_path / "in.txt"
    p.write_bytes(b"a\r\n\nb\xc3\xa8")
    items, sha = read_inputs(p)
    assert [(i.id, i.prompt) for i in items] == [(1, "a"), (2, ""), (3, "bè")]
    assert len(sha) == 64
    p.write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(BadInput, match="not valid UTF-8") as info:
        read_inputs(p)
    assert "line 2" in str(info.value.found)
    p.write_bytes(b"")
    with pytest.raises(BadInput, match="no lines"):
        read_inputs(p)
    assert item_seed(10, 1) == item_seed(10, 1) != item_seed(10, 2) != item_seed(20, 2)
    assert 0 <= item_seed(10, 1) < 2**63


def test_a_sparse_gigabyte_ledger_line_is_refused_in_bounded_memory(tmp_path):
    """A ledger whose last line is 1 GiB of zeros (4 KB on disk, sparse) is refused as a corrupt
    record before it is held in memory: the child's peak RSS stays far below the line's size."""
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": 1}\n')
    os.truncate(out, 1 << 30)
    code = (
        "import os, resource, sys\n"
        "from pathlib import Path\n"
        "from ripresa.errors import IntegrityError\n"
        "from ripresa.engine.ledger import _scan_fd\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "try:\n"
        "    _scan_fd(fd, Path(sys.argv[1]), lambda n, line: None)\n"
        "    print('READ')\n"
        "except IntegrityError as exc:\n"
        "    print('REFUSED', exc.message)\n"
        "print('GROWTH_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "REFUSED ledger line 2: line too long for a record" in res.stdout, res.stdout
    growth_kib = int(res.stdout.split("GROWTH_KIB")[1])
    assert growth_kib < 256 * 1024, res.stdout  # < 256 MiB for a 1 GiB line
