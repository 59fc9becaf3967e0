"""Runs that outgrow one machine: node-local run folders, each sharded generation committed through the store.

When the nodes of a ``torchrun`` run share no folder (each has its own NVMe, the object store is the only shared
place), a :class:`~ripresa.Checkpointer` with a ``mirror`` finds it out at its start (:func:`detect`: one file
written by rank 0, looked for by every rank) and works per node (docs/DISTRIBUTED.md):

- each node's first rank (its *leader*) holds that node's run folder (its lock); rank 0 alone keeps the history;
- an FSDP2 save: every rank writes its shards into its node's folder, each node uploads its part itself (all nodes
  at once), the receipts meet on rank 0, and rank 0 writes the companion, the signature and the marker **last**
  into the store (:mod:`ripresa.store.mirror.commit`); then every node keeps its part under the store's very
  marker (``Generation.absent`` names the files it lacks);
- a resume: rank 0 picks the newest generation the store holds committed, every node lands its marker, companion
  and ``.metadata``, and each rank fetches only the shard files its own load reads (:class:`NodeStore.fetch`);
  a node restarted on its machine reads its own files and downloads nothing but what it lacks;
- a lost node: the survivors' next collective fails; :func:`lost_nodes` names the node(s) whose ranks stopped
  beating (:class:`Heartbeat`) and the run ends with :class:`~ripresa.errors.NodeLost` (exit 4).

A DDP model is replicated: every node's leader writes the whole generation into its own folder (so a node that
restarts on its machine reads its own copy), and rank 0's mirror uploads one copy.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import BadInput, IntegrityError, NodeLost, RipresaError, SaveFailed
from ..formats.generation import Generation
from ..io import auth
from ..io.objstore import open_store
from ..io.safe_read import read_small
from ..store.mirror import commit as store_commit
from .distributed import DistContext, fault_point
from .saving import CollectivePipeline

__all__ = ["Heartbeat", "NodeLayout", "NodePipeline", "NodeStore", "detect", "land_replica", "land_sharded", "lost_nodes",
           "node_key", "report_pulled", "watch"]

#: Environment variables that name a node, first found wins (torchrun, Slurm, Kubernetes-style launchers).
NODE_VARIABLES = ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK", "RIPRESA_NODE")
#: Largest marker object read from the store (a few thousand shard lines).
MAX_MARKER = 1 << 22
#: Largest file of a part that every node keeps (companion, ``.metadata``) sent with the marker to every node.
MAX_COMMON = 1 << 28
#: A rank whose heartbeat is older than this (seconds) is counted lost once a collective failed.
STALE_AFTER = 3.0


def node_key() -> str:
    """What names this process's node: the first of :data:`NODE_VARIABLES` set, else the host name."""
    for k in NODE_VARIABLES:
        v = os.environ.get(k)
        if v:
            return f"{k}={v[:64]}"
    return "host=" + socket.gethostname()[:128]


@dataclass(frozen=True)
class NodeLayout:
    """Which ranks share a node, and whether the nodes share the run folder."""

    node: int  #: this process's node (0: the node of rank 0)
    nodes: int
    local_rank: int
    ranks: tuple[tuple[int, ...], ...]  #: the global ranks of each node
    shared: bool  #: every rank sees one run folder (a shared filesystem): ripresa works as on one machine
    names: tuple[str, ...] = field(default=())  #: each node's name (its :func:`node_key`)

    @property
    def is_leader(self) -> bool:
        return self.local_rank == 0

    def node_of(self, rank: int) -> int:
        for i, rs in enumerate(self.ranks):
            if rank in rs:
                return i
        raise ValueError(rank)


def detect(d: DistContext, run_dir: Path) -> NodeLayout | None:
    """The node layout of this group (a collective on every rank), or None on one node.

    One node when ``LOCAL_WORLD_SIZE`` equals ``WORLD_SIZE`` (torchrun sets both): no collective. Else the ranks
    exchange their :func:`node_key`, and rank 0 writes one file into ``run_dir`` that every rank looks for: all
    see it (a shared folder) or only node 0's ranks do (node-local folders). Anything else is refused.
    """
    import torch.distributed as dist

    lw, w = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if lw is not None and lw == w:
        return None
    keys: list[Any] = [None] * d.world_size
    dist.all_gather_object(keys, node_key())
    order: list[str] = []
    for k in keys:
        if k not in order:
            order.append(k)
    if len(order) <= 1:
        return None
    ranks = tuple(tuple(r for r in range(d.world_size) if keys[r] == k) for k in order)
    node = order.index(keys[d.rank])
    token = d.broadcast(secrets.token_hex(8) if d.is_main else None)
    probe = Path(run_dir) / f".ripresa-node-probe.{token}"
    if d.is_main:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
    d.barrier()
    seen: list[Any] = [None] * d.world_size
    dist.all_gather_object(seen, os.path.exists(probe))
    d.barrier()
    if d.is_main:
        probe.unlink(missing_ok=True)
    layout = NodeLayout(node=node, nodes=len(order), local_rank=ranks[node].index(d.rank), ranks=ranks,
                        shared=all(seen), names=tuple(order))
    if not layout.shared and any(seen[r] for rs in ranks[1:] for r in rs):
        raise BadInput("some nodes share the run folder and others do not", file=run_dir,
                       expected="one folder seen by every node, or a folder of its own on each node",
                       found={order[i]: [bool(seen[r]) for r in rs] for i, rs in enumerate(ranks)},
                       hint="give every node its own local --run folder, or one shared folder to all")
    return layout


#: The file each node's leader keeps in its folder of a node-local run: the store is that run's truth.
NODE_LOCAL_FILE = ".ripresa-node-local"


def mark_node_local(run_dir: Path, layout: NodeLayout) -> None:
    """Mark ``run_dir`` as a node's folder of a node-local run (read back by :func:`once_node_local`)."""
    from ..io.fsio import write_atomic

    p = Path(run_dir) / NODE_LOCAL_FILE
    if not os.path.lexists(p):
        write_atomic(p, [f'{{"node": {layout.node}, "nodes": {layout.nodes}}}\n'.encode()])


def once_node_local(run_dir: Path) -> bool:
    """``run_dir`` is a node's folder of a node-local run (resumed now on one node: the store stays the truth)."""
    p = Path(run_dir) / NODE_LOCAL_FILE
    return os.path.lexists(p) and not p.is_symlink() and p.is_file()


def one_node(d: DistContext) -> NodeLayout:
    """The layout of a node-local run resumed on one node: every rank on node 0, folders not shared."""
    local = int(os.environ.get("LOCAL_RANK", "0")) if os.environ.get("LOCAL_RANK", "0").isdigit() else 0
    return NodeLayout(node=0, nodes=1, local_rank=local, ranks=(tuple(range(d.world_size)),), shared=False,
                      names=(node_key(),))


# ---------------------------------------------------------------------------- liveness


class Heartbeat:
    """Each rank beats into the launcher's key-value store every second, so a survivor can name a lost node.

    The store is torchrun's own (``MASTER_ADDR``/``MASTER_PORT``); a key per rank under ``ripresa/alive/``.
    Without it (another launcher) nothing beats and :func:`lost_nodes` names every other node.
    """

    def __init__(self, layout: NodeLayout, rank: int) -> None:
        self.layout, self.rank = layout, rank
        self.store: Any = None
        self._stop = threading.Event()
        try:
            from datetime import timedelta

            import torch.distributed as dist

            base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                 timeout=timedelta(seconds=5))
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            self.store = dist.PrefixStore(f"ripresa/alive/{attempt}/", base)
        except (KeyError, ValueError, RuntimeError, OSError):
            return
        self._beat()
        threading.Thread(target=self._loop, name="ripresa-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        try:
            self.store.set(str(self.rank), repr(time.time()))
        except Exception:  # noqa: BLE001 - the store's node is gone: nothing to beat into
            self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self._beat()

    def stop(self) -> None:
        self._stop.set()

    def stale(self) -> list[int] | None:
        """The ranks whose last beat is older than :data:`STALE_AFTER` (None: the store cannot be read)."""
        if self.store is None:
            return None
        now, out = time.time(), []
        try:
            for r in range(sum(len(rs) for rs in self.layout.ranks)):
                try:
                    t = float(self.store.get(str(r)).decode())
                except (ValueError, UnicodeDecodeError):
                    t = 0.0
                if now - t > STALE_AFTER:
                    out.append(r)
        except Exception:  # noqa: BLE001 - the store went with its node
            return None
        return out


def lost_nodes(layout: NodeLayout, beat: Heartbeat | None, rank: int) -> tuple[list[int], str]:
    """The nodes a survivor counts lost after a collective failed: (node indices, how it knows)."""
    if beat is not None and beat.store is not None:
        time.sleep(STALE_AFTER + 0.5)  # a lost rank's last beat ages past the bound; a live one beats again
        stale = beat.stale()
        if stale is not None:
            nodes = sorted({layout.node_of(r) for r in stale} - {layout.node_of(rank)})
            if nodes:
                return nodes, f"rank(s) {', '.join(map(str, stale))} stopped beating"
        else:
            return [i for i in range(layout.nodes) if i != layout.node], "the launcher's store is gone with its node"
    return [i for i in range(layout.nodes) if i != layout.node], "every other node (no heartbeat store)"


def node_lost_error(layout: NodeLayout, beat: Heartbeat | None, rank: int, exc: BaseException) -> NodeLost:
    """The :class:`~ripresa.errors.NodeLost` a survivor raises for a failed collective ``exc``."""
    nodes, how = lost_nodes(layout, beat, rank)
    names = ", ".join(f"node {i} ({layout.names[i] if i < len(layout.names) else '?'}, ranks "
                      f"{','.join(map(str, layout.ranks[i]))})" for i in nodes)
    return NodeLost(f"lost {names or 'a node'}: {how}; rank {rank} on node {layout.node} stops",
                    found=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
                    hint="start the launcher again on every node (a fresh node resumes from the store); "
                    "the newest generation committed in the store is intact")


def is_collective_failure(exc: BaseException) -> bool:
    """A failure of a collective (a peer gone), as torch raises it from gloo or NCCL."""
    name = type(exc).__name__
    if name in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo", "NCCL", "Timed out"))


# ---------------------------------------------------------------------------- the store


class NodeStore:
    """This rank's handle on the store of a node-local run: uploads of its node's part, fetches, the commit."""

    def __init__(self, url: str, layout: NodeLayout, *, event: Callable[..., None] | None = None,
                 keep: Any = None) -> None:
        self.layout = layout
        self.remote = open_store(url)
        self.url = url
        self.event = event
        self.keep = keep  #: the store's retention (a RetentionPolicy), applied by rank 0 after each commit
        self.pulled_bytes = 0
        self.pulled_objects = 0
        self._lock = threading.Lock()

    # -- a resume --------------------------------------------------------------------------------------
    def listing(self) -> dict[str, int]:
        return store_commit.retrying(self.remote.list, self.event, "listing")

    def fetch(self, folder: Path, name: str, sha256: str, size: int | None) -> None:
        """Land ``folder/name`` from the store (verified); counted in :attr:`pulled_bytes`."""
        if size is None:
            raise IntegrityError("a file to fetch has no committed size", file=folder / name)
        self.count(store_commit.fetch_object(self.remote, f"{folder.name}/{name}", folder / name, sha256=sha256,
                                             size=size), 1)

    def count(self, n: int, objects: int) -> None:
        """``n`` bytes in ``objects`` objects pulled from the store by this rank."""
        with self._lock:
            self.pulled_bytes += n
            self.pulled_objects += objects

    def newest(self, accept: Callable[[str], int | None]) -> tuple[int, str, bytes, bytes | None, dict[str, int]] | None:
        """Rank 0: the newest generation the store holds committed: (step, main, marker, signature or None,
        the listed size of each of its objects by file name)."""
        listing = store_commit.retrying(self.remote.list, self.event, "listing")
        for step, main in store_commit.newest_committed(listing, accept):
            marker = store_commit.read_marker(self.remote, main + ".sha256", MAX_MARKER)
            sig_key = main + ".hmac"
            sig = store_commit.read_marker(self.remote, sig_key, auth.MAX_SIGNATURE) if sig_key in listing else None
            sizes = {k[len(main) + 1:]: n for k, n in listing.items() if k.startswith(main + "/")}
            return step, main, marker, sig, sizes
        return None

    def land(self, run_dir: Path, main: str, marker: bytes, sig: bytes | None, hashes: dict[str, str],
             sizes: dict[str, int], always: tuple[str, ...]) -> None:
        """A node leader: its folder ``run_dir/main`` holds the store's generation ``main`` as a node's part.

        Files it holds that the marker does not vouch for (another attempt of the step, a damaged copy) are
        removed; the ``always`` files (companion, ``.metadata``) are fetched when absent (each at most its listed
        size, compared with the marker's sha256); then the signature, and the marker last.
        """
        from ..io.fsio import ops, write_atomic
        from ..io.hashing import sha256_file

        folder = run_dir / main
        mk = run_dir / (main + ".sha256")
        if os.path.lexists(mk):
            mk.unlink()  # uncommitted locally while its files change
        if os.path.lexists(folder) and (folder.is_symlink() or not folder.is_dir()):
            os.unlink(folder)
        folder.mkdir(exist_ok=True)
        for e in list(os.scandir(folder)):
            want = hashes.get(e.name)
            if e.is_dir(follow_symlinks=False):
                ops.rmtree(folder / e.name)
            elif want is None or e.is_symlink() or not e.is_file(follow_symlinks=False) or \
                    sha256_file(folder / e.name).sha256 != want:
                os.unlink(folder / e.name)
        for name in always:
            if not os.path.lexists(folder / name):
                if name not in hashes or name not in sizes:
                    raise IntegrityError("the store's generation lacks a file every node needs", file=f"{main}/{name}",
                                         expected=name, found=sorted(hashes)[:8])
                self.fetch(folder, name, hashes[name], sizes[name])
        ops.fsync_dir(folder)
        if sig is not None:
            write_atomic(run_dir / (main + ".hmac"), [sig])
        write_atomic(mk, [marker])
        ops.fsync_dir(run_dir)

    # -- retention -------------------------------------------------------------------------------------
    def retain(self, accept: Callable[[str], int | None], newest: int) -> list[int]:
        """Rank 0, after a commit: the store's committed generations the store's retention drops, deleted
        marker first; objects of an older step left without a marker (a commit cut short) go too."""
        if self.keep is None:
            return []
        listing = store_commit.retrying(self.remote.list, self.event, "listing")
        committed = {main: step for step, main in store_commit.newest_committed(listing, accept)}
        steps = sorted(set(committed.values()))
        keep = self.keep.keep_scored(steps, {}) | {newest}
        dropped = []
        for main, step in sorted(committed.items(), key=lambda x: x[1]):
            if step in keep:
                continue
            keys = sorted((k for k in listing if k == main + ".sha256" or k.startswith(main + "/") or
                           k.startswith(main + ".")), key=lambda k: (not k.endswith(".sha256"), k))
            for k in keys:
                store_commit.retrying(lambda k=k: self.remote.delete(k), self.event, k)
            dropped.append(step)
        return dropped


# ---------------------------------------------------------------------------- the save


class NodePipeline(CollectivePipeline):
    """FSDP2 on node-local folders: every rank writes into its node's folder, each node uploads its part, rank 0
    commits in the store (marker last), then every node keeps its part under that marker (module doc)."""

    def __init__(self, *args: Any, nodes: NodeStore, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.nodes = nodes

    def write(self, step: int, reason: str, must_succeed: bool, extra: dict[str, Any] | None, t0: float) -> bool:
        d, ns, b = self.dist, self.nodes, self.backend
        leader = ns.layout.is_leader
        if leader:
            b.prepare(step)  # a stale partial of this step, on this node
        d.barrier()
        error: str | None = None
        try:
            b.write_part(step, self.state)
        except Exception as exc:  # DCP reports a failure on every rank
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
        fault_point("after_shards", step, d.rank)
        d.barrier()  # every rank of every node has written its shards
        receipts: list[store_commit.Receipt] | None = None
        folder: Path | None = None  # this node's partial folder (its leader's)
        if leader and error is None:
            try:
                folder, names = b.part_files(step)
                receipts = store_commit.upload_part(ns.remote, folder, b.names.name(step), names, event=ns.event)
                fault_point("node_uploaded", step, d.rank)
            except (RipresaError, OSError) as exc:
                error = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        every = d.all_gather((error, receipts))
        errors = [e for e, _ in every if e]
        marker: bytes | None = None
        sig: bytes | None = None
        common: dict[str, bytes] = {}
        error = "; ".join(errors)[:600] or None
        if d.is_main and error is None and folder is not None:
            try:
                marker, sig = self._commit_in_store(step, folder, extra, [r for _, rs in every if rs for r in rs])
                common = {n: read_small(folder / n, "node part file", MAX_COMMON, error=IntegrityError)
                          for n in b.part_common}
            except (RipresaError, OSError) as exc:
                error = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        # the few small files every node's part holds (companion, .metadata) travel with the marker: a node
        # that restarts on its machine reads them from its own folder
        error, marker, sig, common = d.broadcast((error, marker, sig, common))
        if error is None and leader:
            try:
                if not d.is_main and folder is not None:
                    from ..io.fsio import write_atomic

                    for n, data in common.items():
                        write_atomic(folder / n, [data])
                b.land_part(step, marker, sig)
            except (RipresaError, OSError) as exc:  # the store holds it: this node re-lands it at its resume
                error = f"node {ns.layout.node} kept no local part: {exc}"
        if error is not None and marker is None:
            if leader:
                b.abandon(step)
            self.fail(step, SaveFailed(f"sharded save of step {step} failed: {error}", file=self.run_dir,
                                       hint="the previous generation is intact in the store"), must_succeed)
            return False
        self.stalls.append(time.perf_counter() - t0)
        if leader:
            retain = getattr(b, "retain", None)
            if retain is not None:
                retain(step)
        if d.is_main:
            total = sum(r.size for _, rs in every if rs for r in rs)  # every node's part (node 0's check sees its own)
            gen = b.check(step)
            self.commit(replace(gen, size=total + (gen.size or 0) - sum(r.size for r in (every[0][1] or ()))),
                        reason, time.perf_counter() - t0)
            try:
                ns.retain(b.names.parse, step)
            except (RipresaError, OSError) as exc:  # the generation stands; the next commit retries
                ns.event and ns.event("store_retention_failed", step=step, error=str(exc)[:300])
        return True

    def _commit_in_store(self, step: int, folder: Path, extra: dict[str, Any] | None,
                         receipts: list[store_commit.Receipt]) -> tuple[bytes, bytes | None]:
        """Rank 0: the companion (every node's files), its upload, the signature and the marker, last."""
        b, ns = self.backend, self.nodes
        sizes = {r.key.split("/", 1)[1]: r.size for r in receipts}
        name = b.seal_part(step, self.state, self.progress(), extra, world_size=self.dist.world_size, sizes=sizes)
        comp = store_commit.upload_part(ns.remote, folder, b.names.name(step), [name], event=ns.event)
        hashes = {r.key.split("/", 1)[1]: r.sha256 for r in [*receipts, *comp]}
        marker_name, marker, sig = b.marker_of(step, hashes)
        store_commit.commit_marker(ns.remote, marker_name, marker, [*receipts, *comp], signature=sig, event=ns.event)
        return marker, None if sig is None else sig[1]


def reroot(gen: Generation, run_dir: Path) -> Generation:
    """``gen`` (rank 0's) as this node's folder holds it: the same names under this node's ``run_dir``."""
    path = Path(run_dir) / gen.path.name
    comp = path / gen.companion.name if gen.companion.parent == gen.path else Path(run_dir) / gen.companion.name
    return replace(gen, path=path, companion=comp, marker=Path(run_dir) / gen.marker.name)



# ---------------------------------------------------------------------------- the resume (every rank calls these)


def _rank0_decides(d: DistContext, fn: Callable[[], Any], url: str) -> Any:
    """``fn()`` on rank 0 (a look at the store), its value on every rank; a failure there is raised on every rank."""
    value, error = None, None
    if d.is_main:
        try:
            value = fn()
        except RipresaError as exc:
            error = exc.message
    value, error = d.broadcast((value, error))
    if error is not None:
        raise BadInput(f"rank 0 could not list the store: {error}", file=url,
                       hint="the store must be reachable to resume a run on node-local folders")
    return value


def _every_leader(d: DistContext, layout: NodeLayout, fn: Callable[[], None], what: str, url: str) -> None:
    """``fn()`` on every node's leader; a failure on any node is raised on every rank."""
    failed = None
    if layout.is_leader:
        try:
            fn()
        except (RipresaError, OSError) as exc:
            failed = f"node {layout.node}: {getattr(exc, 'message', None) or exc}"
    errors = [e for e in d.all_gather(failed) if e]
    if errors:
        raise IntegrityError(f"{what} could not be landed on every node", file=url, found="; ".join(errors)[:600],
                             hint="check the store with ripresa inspect URL")


def land_sharded(d: DistContext, ns: NodeStore, run_dir: Path, backend: Any) -> Path | None:
    """A sharded kind: rank 0 names the store's newest committed generation, every node's leader lands its
    marker, companion and ``.metadata`` as its part; the generation's path in this node's folder (None: none)."""
    from ..store.kinds import generation_files

    choice = _rank0_decides(d, lambda: ns.newest(backend.names.parse), ns.url)
    if choice is None:
        return None
    step, main, marker, sig, sizes = choice

    def land() -> None:
        files = generation_files(main, marker, where=f"{ns.url}/{main}.sha256")
        ns.land(run_dir, main, marker, sig, {k.split("/", 1)[1]: sha for sha, k in files}, sizes,
                always=backend.part_common)

    _every_leader(d, ns.layout, land, f"the store's generation {main}", ns.url)
    return run_dir / main


def land_replica(d: DistContext, ns: NodeStore, run_dir: Path, backends: list[Any], store: Any,
                 event: Callable[..., None]) -> Path | None:
    """A replicated (DDP) run: the newest step every node holds or the store holds committed; a node without
    it pulls it whole from the store. The generation's path in this node's folder (None: none)."""
    from ..store.mirror import pull_run

    layout = ns.layout
    local: dict[int, str] = {}
    if layout.is_leader:
        for b in backends:
            for g in b.generations():
                if g.valid:
                    local.setdefault(g.step, g.path.name)
    every = d.all_gather(sorted(local) if layout.is_leader else None)
    held = _rank0_decides(d, lambda: sorted({step for b in backends
                                             for step, _ in store_commit.newest_committed(ns.listing(), b.names.parse)}),
                          ns.url)
    steps = [set(x) for x in every if x is not None]
    candidates = set(held) | (set.intersection(*steps) if steps else set())
    if not candidates:
        return None
    step = max(candidates)

    def pull() -> None:
        if step in local:
            return
        gen = pull_run(ns.remote, run_dir, store, step=step, kinds=[b.kind for b in backends], event=event)
        if gen is None:
            raise IntegrityError(f"the store holds no verified generation of step {step}", file=ns.url)
        local[step] = gen.path.name
        ns.count(gen.size or 0, len(gen.files))

    _every_leader(d, layout, pull, f"step {step}", ns.url)
    return run_dir / d.broadcast(local.get(step))


def report_pulled(d: DistContext, ns: NodeStore, gen: Generation | None, event: Callable[..., None]) -> None:
    """Every rank's pulled bytes, summed per node: one ``nodes_pulled`` history event and one line on rank 0."""
    from .. import console
    from ..store.mirror.plan import size_text

    per_node: dict[int, list[int]] = {}
    for node, n, k in d.all_gather((ns.layout.node, ns.pulled_bytes, ns.pulled_objects)):
        acc = per_node.setdefault(node, [0, 0])
        acc[0] += n
        acc[1] += k
    if gen is None:
        return
    event("nodes_pulled", step=gen.step, file=gen.path.name,
          nodes={str(i): {"bytes": v[0], "objects": v[1]} for i, v in sorted(per_node.items())})
    if d.is_main:
        text = ", ".join(f"node {i} pulled {size_text(v[0])} ({v[1]} objects)" for i, v in sorted(per_node.items()))
        sys.stderr.write(console.one_line(f"ripresa: resumed {gen.path.name} from the store: {text}") + "\n")
        sys.stderr.flush()


def watch(layout: NodeLayout, rank: int) -> Heartbeat:
    """A rank of a multi-node run: bound to its launcher, beating, and a failed collective read as
    :class:`~ripresa.errors.NodeLost` (docs/DISTRIBUTED.md, "Losing a node")."""
    from .. import console
    from .torchrun import bind_to_agent

    bind_to_agent()  # a lost node's ranks die with its launcher; the survivors learn it at once
    beat = Heartbeat(layout, rank)

    def translate(exc: BaseException) -> BaseException | None:
        return node_lost_error(layout, beat, rank, exc) if is_collective_failure(exc) else None

    console.TRANSLATORS.append(translate)
    return beat
