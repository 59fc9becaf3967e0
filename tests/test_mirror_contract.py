"""The mirror's one contract (store/mirror/contract.py; docs/ARCHITECTURE.md, "Storage backends").

``Mirror`` keeps the four promises of ``MirrorContract`` against a real folder store that records the order of
its writes: it lists what is committed, plans, uploads a generation's files first (each checked against the
local marker's sha256: a file changed after its commit is never uploaded) and the marker object last, and
pulls a generation back verified. A generation's files are its kind's to name (``kinds.generation_files``):
a kind registered here, a folder of per-rank files the mirror has never heard of, is planned and uploaded
like any other, and a marker naming files that are not its generation's is refused whatever the kind.

No module of store/mirror names a kind (an AST scan of its string literals for the registered kinds' names and
suffixes): which kind a pull prefers at equal steps is the registry's (``BackendSpec.pull_rank``), and a kind
re-registered with another preference changes the pull's choice. The pull and the upload thread retry by one
back-off policy (store/mirror/retry.py): tries, jittered exponential waits, an event per retry, a stop check,
a one-try mode.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import threading
import time
from pathlib import Path

import pytest
from support.mirror_train import train

import ripresa.store.mirror
from ripresa.errors import IntegrityError
from ripresa.formats.naming import NameFormat
from ripresa.io.folderstore import LocalStore
from ripresa.io.objstore import RemoteNotFound, RemoteUnavailable
from ripresa.store.backend import (
    BackendSpec,
    DcpBackend,
    generation_files,
    kinds,
    register_backend,
    spec_of,
    unregister_backend,
)
from ripresa.store.mirror import (
    MIRROR_MARKER,
    Mirror,
    MirrorContract,
    MirrorSpec,
    MirrorTarget,
    local_generations,
    retrying,
)
from ripresa.store.mirror.retry import Retry, Stopped
from ripresa.store.retention import KeepLast
from ripresa.store.store import CheckpointStore


class Recording(LocalStore):
    """A real folder store that remembers the order of the objects it was asked to write."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, str(root))
        self.writes: list[str] = []

    def put_file(self, key: str, path: Path, *, sha256: str) -> int:
        n = super().put_file(key, path, sha256=sha256)
        self.writes.append(key)
        return n

    def put_bytes(self, key: str, data: bytes) -> None:
        super().put_bytes(key, data)
        self.writes.append(key)


def mirror_of(run: Path, remote: Path, events: list[tuple[str, dict]]) -> tuple[Mirror, Recording]:
    rec = Recording(remote)
    m = Mirror(MirrorSpec(str(remote), attempts=1), run, local_retention=KeepLast(3),
               event=lambda name, **kw: events.append((name, kw)), store=MirrorTarget(rec, explicit=True))
    return m, rec


def test_mirror_keeps_the_contract_list_plan_upload_marker_last_and_pull(tmp_path):
    run, remote = tmp_path / "run", tmp_path / "mirror"
    train(run, 4, 2)  # two general generations, no mirror
    local = local_generations(run)
    (main2, _), (main4, _) = sorted(local.items(), key=lambda x: x[1])
    events: list[tuple[str, dict]] = []
    m, rec = mirror_of(run, remote, events)
    assert isinstance(m, MirrorContract)
    assert m.committed() == {}
    assert m.plan().steps == [2, 4]

    m.upload(main2, 2)
    files = generation_files(main2, (run / f"{main2}.sha256").read_bytes(), where="test")
    ours = [k for k in rec.writes if k.startswith(main2)]
    assert ours == [n for _, n in files] + [f"{main2}.sha256"]  # its kind's files, then the marker LAST
    assert m.committed() == {main2: 2}

    target = run / main4
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # changed after its commit: its sha256 is no longer the marker's
    target.write_bytes(bytes(raw))
    m.upload(main4, 4)
    assert f"{main4}.sha256" not in rec.writes and m.committed() == {main2: 2}  # never committed in the store
    assert any(n == "mirror_skipped" and kw["step"] == 4 for n, kw in events)

    m.close()

    new = tmp_path / "new"  # a blank machine: a mirror of a new run folder, on the same store
    pulled: list[tuple[str, dict]] = []
    blank, _ = mirror_of(new, remote, pulled)
    with CheckpointStore(new) as store:
        with pytest.raises(ValueError, match="its own run folder"):
            m.pull(store)  # a mirror lands generations in its own run folder only
        gen = blank.pull(store)
    assert gen is not None and gen.step == 2 and gen.valid and gen.deep_checked
    for _, name in files:
        assert (new / name).read_bytes() == (run / name).read_bytes()
    assert sorted(local_generations(new).values()) == [2]
    assert any(n == "mirror_pulled" and kw["step"] == 2 for n, kw in pulled)
    blank.close()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def ranks_kind():
    """A folder kind of per-rank files that no mirror module names (its backend only matters to a pull)."""
    register_backend(BackendSpec("ranks", DcpBackend, {"fsdp2": 90}, names=NameFormat(".ranks", folder=True)))
    try:
        yield
    finally:
        unregister_backend("ranks")


def test_a_new_folder_kind_is_planned_and_uploaded_by_its_own_names(tmp_path, ranks_kind):
    run, remote = tmp_path / "run", tmp_path / "mirror"
    gen = run / "step_000003.ranks"
    gen.mkdir(parents=True)
    lines = b""
    for rank in range(3):  # each rank's shard, as each node would write its own
        body = f"rank {rank}".encode() * 100
        (gen / f"rank{rank}.bin").write_bytes(body)
        lines += f"{_sha(body)}  step_000003.ranks/rank{rank}.bin\n".encode()
    (run / "step_000003.ranks.sha256").write_bytes(lines)
    m, rec = mirror_of(run, remote, [])
    assert m.plan().steps == [3]
    m.upload("step_000003.ranks", 3)
    assert [k for k in rec.writes if k != MIRROR_MARKER] == [f"step_000003.ranks/rank{r}.bin" for r in range(3)] + ["step_000003.ranks.sha256"]
    assert m.committed() == {"step_000003.ranks": 3}
    assert (remote / "step_000003.ranks" / "rank1.bin").read_bytes() == (gen / "rank1.bin").read_bytes()
    m.close()


@pytest.mark.parametrize("main, names", [
    ("step_000003.ranks", ["step_000003.ranks/a", "step_000004.ranks/b"]),  # another generation's file
    ("step_000003.ranks", ["step_000003.ranks/a", "step_000003.bin"]),  # another kind's file
    ("step_000003.ranks", ["step_000003.ranks/a", "step_000003.ranks.hmac"]),  # a signature
    ("step_000003.ranks", ["step_000003.ranks/a", "step_000003.ranks/a"]),  # a name twice
    ("step_000003.ranks", ["step_000003.ranks/a"]),  # one line only
    ("step_000003.bin", ["step_000003.bin/x", "step_000003.json"]),  # a folder name for a kind of files
    ("step_000003.ranks", ["step_000003.ranks", "step_000003.ranks/a"]),  # a folder kind's file outside its folder
])
def test_a_marker_naming_files_that_are_not_its_generations_is_refused(main, names, ranks_kind):
    raw = b"".join(f"{'0' * 64}  {n}\n".encode() for n in names)
    with pytest.raises(IntegrityError, match="malformed commit marker"):
        generation_files(main, raw, where="m")


def test_generation_files_keeps_the_markers_lines_in_order(ranks_kind):
    names = ["step_000003.ranks/rank1.bin", "step_000003.ranks/rank0.bin", "step_000003.ranks/meta.json"]
    raw = b"".join(f"{str(i) * 64}  {n}\n".encode() for i, n in enumerate(names))
    assert generation_files("step_000003.ranks", raw, where="m") == [(str(i) * 64, n) for i, n in enumerate(names)]


# ---------------------------------------------------------------------------- the mirror names no kind

MIRROR_PACKAGE = Path(ripresa.store.mirror.__file__).parent


def kind_words() -> tuple[set[str], set[str]]:
    """What names a kind in source: each registered kind's name and old names (a whole string), and each
    kind's file suffix (``.safetensors``, ``.dcp``, ...) and DCP's rank files (``.distcp``) anywhere in one."""
    names = {n for s in kinds() for n in (s.kind, *s.aliases)}
    suffixes = {s.naming.suffix for s in kinds() if s.naming is not None} | {".distcp"}
    return names, suffixes


def kinds_named(source: str) -> list[tuple[int, str]]:
    """The string literals of ``source`` (docstrings aside) that name a kind: (line, literal)."""
    tree = ast.parse(source)
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    names, suffixes = kind_words()
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            and (node.value in names or any(s in node.value for s in suffixes))]


def test_no_module_of_the_mirror_names_a_kind():
    assert kinds_named('PULL_KINDS = ("bin", "general")\nx = f"{m}/__0_0.distcp"\n') == [
        (1, "bin"), (1, "general"), (2, "/__0_0.distcp")]  # the scan sees what it looks for
    modules = sorted(MIRROR_PACKAGE.glob("*.py"))
    assert {"pull.py", "upload.py", "layout.py", "retry.py"} <= {p.name for p in modules}
    found = {p.name: hits for p in modules if (hits := kinds_named(p.read_text()))}
    assert found == {}, f"store/mirror names kinds (ask the registry, ripresa.store.kinds): {found}"


def test_the_pull_prefers_at_equal_steps_what_the_registry_of_kinds_says(tmp_path):
    remote = tmp_path / "mirror"
    for fmt in ("andrea", "general"):  # one .bin and one general generation, both of step 2, in one store
        run = tmp_path / fmt
        train(run, 2, 2, fmt=fmt)
        m, _ = mirror_of(run, remote, [])
        for main, step in local_generations(run).items():
            m.upload(main, step)
        m.close()
    general = spec_of("general")
    chosen = []
    for rank in (general.pull_rank, 5):  # the registry's preference, then general re-registered before .bin
        register_backend(dataclasses.replace(general, pull_rank=rank))
        try:
            blank = tmp_path / f"blank{rank}"
            m, _ = mirror_of(blank, remote, [])
            with CheckpointStore(blank) as store:
                gen = m.pull(store)
            m.close()
        finally:
            register_backend(general)
        assert gen is not None and gen.step == 2 and gen.valid
        chosen.append(gen.kind)
    assert chosen == ["bin", "general"]
    assert spec_of("general") == general and [s.kind for s in kinds()] == ["bin", "dcp", "general", "shards"]


# ---------------------------------------------------------------------------- one back-off policy


class Flaky:
    """A request that fails ``n`` times (``exc``), then returns "ok"; the events of its retries recorded."""

    def __init__(self, n: int, exc: type[Exception] = RemoteUnavailable) -> None:
        self.n, self.exc, self.calls, self.events = n, exc, 0, []

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.n:
            raise self.exc(f"down {self.calls}", file="s3://b/p", found="HTTP 503")
        return "ok"

    def event(self, name: str, **kw) -> None:
        self.events.append((name, kw))


def test_the_back_off_policy_tries_waits_records_stops_and_tries_once():
    policy = Retry(attempts=3, backoff=0.01, max_backoff=0.02)
    f = Flaky(2)
    assert policy.call(f, what="k", step=7, event=f.event) == "ok" and f.calls == 3
    assert [(n, kw["step"], kw["object"], kw["attempt"], kw["error"], kw["found"]) for n, kw in f.events] == [
        ("mirror_retry", 7, "k", 1, "down 1", "HTTP 503"), ("mirror_retry", 7, "k", 2, "down 2", "HTTP 503")]
    assert 0.005 <= f.events[0][1]["wait"] <= 0.015 and 0.01 <= f.events[1][1]["wait"] <= 0.03  # 2^k, jittered
    f, seen = Flaky(5), []
    with pytest.raises(RemoteUnavailable, match="down 3"):  # the last failure is raised
        policy.call(f, what="k", event=f.event, failed=seen.append)
    assert f.calls == 3 and len(f.events) == 2 and [e.message for e in seen] == ["down 1", "down 2", "down 3"]
    f = Flaky(1)
    with pytest.raises(RemoteUnavailable):  # the one-try mode: no retry, no event
        policy.call(f, what="k", event=f.event, once=True)
    assert f.calls == 1 and f.events == []
    f = Flaky(1, RemoteNotFound)
    with pytest.raises(RemoteNotFound):  # only what it is told to retry is retried
        policy.call(f, what="k")
    assert f.calls == 1
    assert policy.call(Flaky(1, RemoteNotFound), what="k", retry_on=(RemoteNotFound,)) == "ok"
    f = Flaky(2)
    assert Retry(3, 50.0, 100.0).call(f, what="k", event=f.event, cap=lambda: 0.001) == "ok"  # a close's cap
    assert [kw["wait"] for _, kw in f.events] == [0.001, 0.001]
    stop = threading.Event()
    stop.set()
    f = Flaky(0)
    with pytest.raises(Stopped):  # checked before a try
        policy.call(f, what="k", stop=stop)
    assert f.calls == 0
    stop.clear()
    f = Flaky(5)
    t0 = time.monotonic()
    with pytest.raises(Stopped):  # and during the wait, which it ends at once
        Retry(3, 60.0, 60.0).call(f, what="k", event=lambda *a, **kw: stop.set(), stop=stop)
    assert f.calls == 1 and time.monotonic() - t0 < 5


def test_the_pull_and_the_upload_thread_retry_by_the_one_policy(tmp_path, monkeypatch):
    calls: list[dict] = []
    real = Retry.call

    def spy(self, fn, **kw):
        calls.append(kw)
        return real(self, fn, **kw)

    monkeypatch.setattr(Retry, "call", spy)
    fast = MirrorSpec(str(tmp_path / "mirror"), attempts=3, backoff=0.0, max_backoff=0.0)
    f = Flaky(2)
    assert retrying(f, event=f.event, what="run.json", spec=fast) == "ok" and len(f.events) == 2
    assert [c["what"] for c in calls] == ["run.json"]
    events: list[tuple[str, dict]] = []
    m = Mirror(fast, tmp_path / "run", local_retention=KeepLast(3), event=lambda n, **kw: events.append((n, kw)),
               store=MirrorTarget(LocalStore(tmp_path / "mirror", str(tmp_path / "mirror")), explicit=True))
    f = Flaky(1)
    with pytest.raises(RemoteUnavailable):  # the session's first listing: one try (an unreachable store says so)
        m._retry(None, "listing", f)
    assert f.calls == 1 and calls[-1]["once"] is True
    f = Flaky(2, RemoteNotFound)
    assert m._retry(4, "step_000004.bin", f) == "ok" and f.calls == 3
    assert [(n, kw["step"], kw["attempt"]) for n, kw in events] == [("mirror_retry", 4, 1), ("mirror_retry", 4, 2)]
    f = Flaky(5, RemoteNotFound)
    with pytest.raises(RemoteUnavailable, match="down 3"):  # whatever failed last, the round sees an unavailable store
        m._retry(4, "step_000004.bin", f)
    assert len(calls) == 4 and all(c["stop"] is m._stop for c in calls[1:])
    m.close()
