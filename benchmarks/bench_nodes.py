"""Save-to-commit time of a multi-node run on node-local disks (docs/DISTRIBUTED.md), against a rank-0 upload.

    .venv/bin/python benchmarks/bench_nodes.py                   # ~100 MB state, 4 saves per alternative
    .venv/bin/python benchmarks/bench_nodes.py --width 4096      # ~200 MB

Starts a real S3 server (moto) in this process and, in front of it, one
bandwidth-limited TCP proxy per "node" (tests/support/s3server.py's
FaultProxy with a shared per-node clock): every connection is held to
``--conn-mbps`` (a real object store gives each client connection a bounded
bandwidth), every request's answer waits ``--latency-ms`` (the store's
round trip), and ``--uplink-mbps`` (0: off) bounds what one node sends in
all. Then, side by side in one run, on the same FSDP2 state
(tests/fixtures/fsdp_loop.py, ``--width W``: 12·(W² + 10·W) bytes):

* ``nodes.s3`` / ``nodes.file``: 2 nodes × 2 ranks (one ``torchrun`` per node,
  tests/support/nodes.py), node-local run folders, the per-node parallel
  commit (every node uploads its part, rank 0 writes the marker last);
  each save's save-to-commit seconds from node 0's history, bytes uploaded
  per node (on the wire, per node's proxy), requests to the store;
* ``one.s3_8`` / ``one.s3_1`` / ``one.file_*``: the same generation's files
  (all ranks', in one folder) pushed by ONE process through
  ``store.mirror.commit.upload_part`` with ``MAX_PARALLEL_UPLOADS`` threads
  and with 1, then ``commit_marker`` (listing + marker): a rank-0 upload;
* ``single.s3``: one ``torchrun`` with 4 ranks and a shared folder, the
  mirror of rank 0 uploading each committed generation (ripresa's path on one
  machine): save-to-store = the save plus its upload.

It prints the medians and minimums, a model on paper for 64 nodes × 8 ranks
(inputs: the per-connection bandwidth, request latency and disk write speed
measured here) and writes ``benchmarks/results/bench_nodes_<W>[_uplink<U>].json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from support.nodes import ENV, FSDP_LOOP, Node, free_port  # noqa: E402
from support.s3server import FaultProxy, MotoServer  # noqa: E402

MB = 1e6
AWS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
       "AWS_EC2_METADATA_DISABLED": "true"}
NODES, RANKS = 2, 2  # the measured layout: 2 nodes × 2 ranks


# ---------------------------------------------------------------------------- the store


class Uplink(FaultProxy):
    """A node's way to the store: each connection at most ``conn_bps`` up, all of them at most ``uplink_bps``
    (None: unbounded), each answer after ``latency_s``; counts what the node sent."""

    def __init__(self, upstream_port: int, *, conn_bps: float | None, uplink_bps: float | None,
                 latency_s: float) -> None:
        super().__init__(upstream_port)
        self.conn_bps, self.uplink_bps, self.latency_s = conn_bps, uplink_bps, latency_s
        self.sent = 0
        self.connections = 0
        self._clock = 0.0
        self._ulock = threading.Lock()
        self._asked: dict[int, list[bool]] = {}

    def _pump(self, src: Any, dst: Any, upload: bool) -> None:
        client = src if upload else dst
        with self._ulock:
            if upload:
                self.connections += 1
            asked = self._asked.setdefault(id(client), [False])
        clock = 0.0
        try:
            while True:
                piece = src.recv(16384 if upload else 65536)
                if not piece:
                    break
                if upload:
                    now = time.monotonic()
                    due = now
                    if self.conn_bps:
                        clock = max(clock, now) + len(piece) / self.conn_bps
                        due = clock
                    with self._ulock:
                        if self.uplink_bps:
                            self._clock = max(self._clock, now) + len(piece) / self.uplink_bps
                            due = max(due, self._clock)
                        self.sent += len(piece)
                    if due > now:
                        time.sleep(due - now)
                    asked[0] = True
                elif asked[0]:  # the first bytes of an answer: the store's round trip
                    asked[0] = False
                    if self.latency_s:
                        time.sleep(self.latency_s)
                dst.sendall(piece)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(2)
            with self._ulock:
                self._asked.pop(id(client), None)


class Requests(logging.Handler):
    """Every request the S3 server answered (werkzeug's access log): (time, method, path)."""

    LINE = re.compile(r'"(GET|PUT|POST|DELETE|HEAD) (\S+) HTTP')

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[tuple[float, str, str]] = []
        self._l = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        m = self.LINE.search(record.getMessage())
        if m:
            with self._l:
                self.seen.append((time.time(), m[1], m[2]))

    def between(self, t0: float, t1: float) -> list[tuple[float, str, str]]:
        with self._l:
            return [r for r in self.seen if t0 <= r[0] <= t1]


def classify(reqs: list[tuple[float, str, str]], bucket: str, prefix: str, step: int) -> dict[str, Any]:
    """The requests of one save: its objects' PUTs (multipart parts included), listings, the rest."""
    main = f"step_{step:06d}.dcp"
    out: dict[str, Any] = {"objects": 0, "parts": 0, "listings_seen": 0, "marker": 0, "signature": 0, "other": 0,
                           "by_node": {str(k): 0 for k in range(NODES)}}
    root = f"/{bucket}/{prefix}/"
    for _, method, path in reqs:
        key, _, query = path.partition("?")
        if method == "GET" and "list-type" in query and key.rstrip("/") == f"/{bucket}":
            out["listings_seen"] += 1
            continue
        if not key.startswith(root):
            out["other"] += 1
            continue
        name = key[len(root):]
        if name == main + ".sha256":
            out["marker"] += 1
        elif name == main + ".hmac":
            out["signature"] += 1
        elif name.startswith(main + "/"):
            base = name.split("/", 1)[1]
            if "partNumber" in query or (method == "POST"):
                out["parts"] += 1
            else:
                out["objects"] += 1
            m = re.fullmatch(r"__(\d+)_\d+\.distcp", base)
            node = int(m[1]) // RANKS if m else 0
            out["by_node"][str(node)] += 1
        else:
            out["other"] += 1
    # the commit lists the store once (commit_marker); a listing more in the window is rank 0's mirror planning
    # its upload of the run's own files (history, config), which runs beside the commit
    out["total_commit"] = out["objects"] + out["parts"] + min(out["listings_seen"], 1) + out["marker"] + out["signature"]
    return out


# ---------------------------------------------------------------------------- launches


def launch(root: Path, nodes: int, nproc: int, args: list[str], envs: list[dict[str, str]]) -> list[Node]:
    """tests/support/nodes.py's launch, with an environment of its own per node (its own way to the store)."""
    port, rdzv = free_port(), uuid.uuid4().hex[:8]
    out = []
    for k in range(nodes):
        run = root / f"node{k}" / "run"
        run.parent.mkdir(parents=True, exist_ok=True)
        log = root / f"node{k}.{rdzv}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv, "--",
               str(FSDP_LOOP), "--run", str(run), *args]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, **ENV, **envs[k]}, start_new_session=True)
        out.append(Node(k, run, proc, log))
    for n in out:
        if n.wait(timeout=900) != 0:
            raise RuntimeError(f"node {n.index} exit {n.proc.returncode}:\n{n.out[-3000:]}")
    return out


def history(run: Path) -> list[dict[str, Any]]:
    out = []
    for line in (run / ".loss.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def loop_args(a: argparse.Namespace, url: str) -> list[str]:
    return ["--sync", "--width", str(a.width), "--every", str(a.every), "--steps", str(a.every * (a.saves + 1)),
            "--mirror", url]


def part_bytes(run: Path, step: int) -> dict[str, int]:
    folder = run / f"step_{step:06d}.dcp"
    return {e.name: e.stat().st_size for e in os.scandir(folder) if e.is_file()}


def run_nodes(a: argparse.Namespace, root: Path, url: str, envs: list[dict[str, str]], log: Requests | None,
              bucket: str, prefix: str, uplinks: list[Uplink] | None) -> dict[str, Any]:
    """2 nodes × 2 ranks on node-local folders: each save's save-to-commit, bytes and requests."""
    sent0 = [u.sent for u in uplinks] if uplinks else None
    nodes = launch(root, NODES, RANKS, loop_args(a, url), envs)
    h = history(nodes[0].run)
    saves = []
    checkpoints = [e for e in h if e.get("event") == "checkpoint"]
    # each node's part of the newest generation (every save has the same shapes; retention keeps the newest)
    newest = checkpoints[-1]["step"]
    per_node = {}
    for k, n in enumerate(nodes):
        p = part_bytes(n.run, newest)
        mine = {n: s for n, s in p.items() if n.endswith(".distcp")}
        extra = {n: s for n, s in p.items() if not n.endswith(".distcp")} if k == 0 else {}
        per_node[str(k)] = {"shard_bytes": sum(mine.values()), "shard_files": len(mine),
                            "extra_bytes": sum(extra.values()), "extra_files": len(extra)}
    for e in checkpoints[1:]:  # the first: warm-up (connections, DCP's first plan)
        step, t1 = e["step"], e["time"]
        t0 = t1 - e["seconds"]
        s: dict[str, Any] = {"step": step, "seconds": e["seconds"], "stall": e.get("stall")}
        if log is not None:
            s["requests"] = classify(log.between(t0 - 0.01, t1 + 0.01), bucket, prefix, step)
        saves.append(s)
    out: dict[str, Any] = {"saves": saves, "nodes": per_node, "newest_step": newest, "checkpoints": len(checkpoints)}
    if uplinks and sent0 is not None:  # everything each node sent, over all its saves (the warm-up included)
        out["wire_bytes_per_node"] = {str(k): u.sent - s0 for k, (u, s0) in enumerate(zip(uplinks, sent0, strict=True))}
    out["layout"] = f"{NODES} nodes x {RANKS} ranks"
    return out


def run_single(a: argparse.Namespace, root: Path, url: str, env: dict[str, str], step_ms: float) -> dict[str, Any]:
    """One torchrun, 4 ranks, a shared folder: rank 0's mirror uploads each committed generation."""
    args = loop_args(a, url) + ["--step-ms", f"{step_ms:.0f}"]
    nodes = launch(root, 1, NODES * RANKS, args, [env])
    h = history(nodes[0].run)
    up = {e["step"]: e for e in h if e.get("event") == "mirror_uploaded"}
    saves = []
    for e in [e for e in h if e.get("event") == "checkpoint"][1:]:  # the first: warm-up
        u = up.get(e["step"])
        if u is None:
            continue
        t0 = e["time"] - e["seconds"]
        saves.append({"step": e["step"], "seconds": round(u["time"] - t0, 4), "local_commit": e["seconds"],
                      "upload": u.get("seconds"), "bytes": u.get("bytes"), "objects": u.get("objects")})
    return {"saves": saves, "layout": f"1 node x {NODES * RANKS} ranks, shared folder, rank-0 mirror"}


# ---------------------------------------------------------------------------- one process


def upload_child(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """In a child process (as a rank would be): upload every file of ``spec['folder']`` and commit, per sample."""
    from ripresa.io.hashing import sidecar_line
    from ripresa.io.objstore import open_store
    from ripresa.store.mirror import commit

    folder = Path(spec["folder"])
    names = sorted(e.name for e in os.scandir(folder) if e.is_file())
    out = []
    warm = open_store(spec["samples"][0][0])  # imports, the client's first connection: not counted
    warm.put_bytes("warm-up", b"x")
    warm.delete("warm-up")
    for url, threads in spec["samples"]:
        commit.MAX_PARALLEL_UPLOADS = threads
        remote = open_store(url)
        main = folder.name
        t0 = time.perf_counter()
        receipts = commit.upload_part(remote, folder, main, names)
        marker = b"".join(sidecar_line(r.sha256, r.key) for r in receipts)
        commit.commit_marker(remote, main + ".sha256", marker, receipts)
        out.append({"url": url, "threads": threads, "seconds": round(time.perf_counter() - t0, 4),
                    "objects": len(receipts), "bytes": sum(r.size for r in receipts)})
    return out


def run_one(folder: Path, samples: list[tuple[str, int]], env: dict[str, str]) -> list[dict[str, Any]]:
    spec = json.dumps({"folder": str(folder), "samples": samples})
    r = subprocess.run([sys.executable, __file__, "--upload-child", spec], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"upload child failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure_link(url: str, env: dict[str, str], scratch: Path, big: int) -> dict[str, float]:
    """Through one idle uplink: a small PUT's round trip (median of 9) and one connection's bandwidth."""
    code = (
        "import json,os,sys,time,statistics\n"
        "from ripresa.io.objstore import open_store\n"
        "r=open_store(sys.argv[1]); small=[]\n"
        "for i in range(9):\n"
        "    t=time.perf_counter(); r.put_bytes(f'probe/small{i}', b'x'*1024); small.append(time.perf_counter()-t)\n"
        "import hashlib; p=sys.argv[2]; sha=hashlib.sha256(open(p,'rb').read()).hexdigest()\n"
        "t=time.perf_counter(); n=r.put_file('probe/big', __import__('pathlib').Path(p), sha256=sha); dt=time.perf_counter()-t\n"
        "print(json.dumps({'latency_s': statistics.median(small), 'big_s': dt, 'big_bytes': n}))\n")
    p = scratch / "probe.bin"
    p.write_bytes(os.urandom(big))
    r = subprocess.run([sys.executable, "-c", code, url, str(p)], env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=600)
    p.unlink()
    if r.returncode != 0:
        raise RuntimeError(f"probe failed:\n{r.stderr[-3000:]}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    # one PUT (below the multipart threshold, the body sent from memory): a round trip, then the bytes; what the
    # client does around it (reading and hashing the file) is counted in, as it is in every upload
    d["conn_bps"] = d["big_bytes"] / max(d["big_s"] - d["latency_s"], 1e-6)
    return d


def disk_write_bps(scratch: Path, size: int = 64 << 20) -> float:
    p = scratch / "disk.bin"
    data = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(p, "wb") as f:
        for _ in range(size >> 20):
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    p.unlink()
    return size / dt


# ---------------------------------------------------------------------------- the model on paper


def paper(*, nodes: int, ranks: int, state: float, small: float, conn_bps: float, latency_s: float,
          disk_bps: float, uplink_bps: float | None, parallel: int, threshold: int, part: int,
          signed: bool = False) -> dict[str, Any]:
    """One save of ``state`` bytes over ``nodes`` × ``ranks`` (a shard file per rank), committed through the
    store: per node in parallel (each node's own ``parallel`` connections), or by one uploader."""
    files = nodes * ranks
    fb = state / files

    def file_requests(size: float) -> int:
        return 1 if size <= threshold else 2 + math.ceil(size / part)

    def upload(nfiles: int, size: float, conns: int) -> float:
        """``nfiles`` files of ``size`` over ``conns`` connections of one uploader (its uplink shared)."""
        c = max(1, min(conns, nfiles))
        bw = conn_bps if not uplink_bps else min(conn_bps, uplink_bps / c)
        one = file_requests(size) * latency_s + size / bw
        return math.ceil(nfiles / c) * one

    listings = math.ceil((files + 3) / 1000)  # one LIST page holds 1000 keys
    commit = (2 * latency_s + small / conn_bps) + listings * latency_s + latency_s * (2 if signed else 1)
    node_bytes = ranks * fb
    write = node_bytes / disk_bps  # a node's ranks write its part on its own disk, every node at once
    t_node = upload(ranks, fb, parallel)  # node 0's .metadata rides along (ranks + 1 files: one more round at worst)
    objects = files + 2  # + .metadata and the companion
    requests = files * file_requests(fb) + 2 + listings + (2 if signed else 1)
    return {
        "nodes": nodes, "ranks_per_node": ranks, "state_bytes": state, "file_bytes": fb,
        "bytes_per_node": node_bytes, "bytes_node0": node_bytes + small, "objects_per_save": objects,
        "requests_per_save": requests, "requests_per_node": ranks * file_requests(fb),
        "per_node": {"write_s": write, "upload_s": t_node, "commit_s": commit, "store_s": t_node + commit,
                     "latency_s": write + t_node + commit},
        "rank0": {conns: {"bytes_through_one_uplink": state + small,
                          "upload_s": upload(files, fb, conns), "store_s": upload(files, fb, conns) + commit,
                          "latency_s": write + upload(files, fb, conns) + commit}
                  for conns in sorted({parallel, 1})},
    }


# ---------------------------------------------------------------------------- main


def stats(xs: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "samples": [round(x, 4) for x in xs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2896, help="the FSDP model's width: 12*(W^2+10W) bytes of state")
    ap.add_argument("--saves", type=int, default=4, help="saves per launch (the samples)")
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--conn-mbps", type=float, default=25.0, help="each connection's bandwidth to the store, MB/s")
    ap.add_argument("--uplink-mbps", type=float, default=0.0, help="one node's bandwidth to the store, MB/s (0: off)")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="added to each answer of the store")
    ap.add_argument("--only", default="", help="comma list of: nodes.s3,nodes.file,one.s3,one.file,single.s3")
    ap.add_argument("--paper-nodes", type=int, default=64)
    ap.add_argument("--paper-ranks", type=int, default=8)
    ap.add_argument("--paper-params", type=float, default=7e9, help="parameters of the model on paper (12 B each)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--upload-child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.upload_child is not None:
        print(json.dumps(upload_child(json.loads(a.upload_child))))
        return 0
    only = set(filter(None, a.only.split(","))) or {"nodes.s3", "nodes.file", "one.s3", "one.file", "single.s3"}

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ripresa.io.objstore_base import MULTIPART_THRESHOLD, PART_SIZE
    from ripresa.store.mirror.commit import MAX_PARALLEL_UPLOADS

    console = Console(width=None if sys.stdout.isatty() else 120)
    import boto3

    log = Requests()
    wl = logging.getLogger("werkzeug")
    wl.setLevel(logging.INFO)
    wl.propagate = False
    wl.handlers[:] = [log]
    moto = MotoServer().start()
    conn_bps = a.conn_mbps * MB or None
    uplink_bps = a.uplink_mbps * MB or None
    lat = a.latency_ms / 1000
    ups = [Uplink(moto.port, conn_bps=conn_bps, uplink_bps=uplink_bps, latency_s=lat) for _ in range(NODES)]
    bucket = "bench-" + uuid.uuid4().hex[:8]
    boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1", aws_access_key_id="bench",
                 aws_secret_access_key="bench").create_bucket(Bucket=bucket)
    s3env = [{**AWS, "AWS_ENDPOINT_URL": u.url} for u in ups]
    scratch = Path(tempfile.mkdtemp(prefix="bench-nodes-", dir=a.dir))
    load0 = os.getloadavg()
    res: dict[str, Any] = {}
    steps = ["probe"] + [k for k in ("nodes.s3", "nodes.file", "one.s3", "one.file", "single.s3") if k in only]
    t_start = time.time()
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as prog:
            task = prog.add_task("probe: the store's round trip and one connection", total=len(steps))

            def note(text: str) -> None:
                prog.update(task, description=text)

            link = measure_link(f"s3://{bucket}/probe", s3env[0], scratch, 16 << 20)
            link["disk_write_bps"] = disk_write_bps(scratch)
            prog.advance(task)
            gen_dir: Path | None = None
            if "nodes.s3" in only:
                note(f"nodes.s3: {NODES} nodes x {RANKS} ranks, per-node upload to S3")
                prefix = "runs/nodes"
                res["nodes.s3"] = run_nodes(a, scratch / "nodes-s3", f"s3://{bucket}/{prefix}", s3env, log, bucket,
                                            prefix, ups)
                last = res["nodes.s3"]["newest_step"]
                gen_dir = scratch / "gen" / f"step_{last:06d}.dcp"
                gen_dir.mkdir(parents=True)
                for k in range(NODES):
                    src = scratch / "nodes-s3" / f"node{k}" / "run" / gen_dir.name
                    for e in os.scandir(src):
                        if k == 0 or e.name.endswith(".distcp"):
                            shutil.copy2(e.path, gen_dir / e.name)
                prog.advance(task)
            if "nodes.file" in only:
                note(f"nodes.file: {NODES} nodes x {RANKS} ranks, per-node copy into a file:// store")
                store = scratch / "store-nodes"
                res["nodes.file"] = run_nodes(a, scratch / "nodes-file", store.as_uri(), [{}, {}], None, bucket, "",
                                              None)
                if gen_dir is None:
                    last = res["nodes.file"]["newest_step"]
                    gen_dir = scratch / "gen" / f"step_{last:06d}.dcp"
                    shutil.copytree(store / gen_dir.name, gen_dir)
                prog.advance(task)
            if gen_dir is None:
                raise SystemExit("one.* needs nodes.s3 or nodes.file (the generation to upload)")
            gen_bytes = sum(e.stat().st_size for e in os.scandir(gen_dir))
            for kind in ("s3", "file"):
                if f"one.{kind}" not in only:
                    continue
                note(f"one.{kind}: every rank's files from one process, {MAX_PARALLEL_UPLOADS} and 1 threads")
                samples = []
                for i in range(a.saves):  # alternating: 8 threads first in even samples, 1 first in odd ones
                    for t in ((MAX_PARALLEL_UPLOADS, 1) if i % 2 == 0 else (1, MAX_PARALLEL_UPLOADS)):
                        url = (f"s3://{bucket}/runs/one-{t}-{i}" if kind == "s3"
                               else (scratch / f"store-one-{t}-{i}").as_uri())
                        samples.append((url, t))
                sent0 = ups[0].sent
                t0 = time.time()
                got = run_one(gen_dir, samples, s3env[0] if kind == "s3" else {})
                for t in sorted({MAX_PARALLEL_UPLOADS, 1}, reverse=True):
                    mine = [g for g in got if g["threads"] == t]
                    res[f"one.{kind}_{t}"] = {"samples_raw": mine, "bytes": mine[0]["bytes"],
                                              "objects": mine[0]["objects"]}
                if kind == "s3":
                    res["one.s3_wire_bytes"] = ups[0].sent - sent0
                    reqs = log.between(t0, time.time())
                    res["one.s3_requests_per_sample"] = len(reqs) / len(samples)
                prog.advance(task)
            if "single.s3" in only:
                # room for each upload before the next save: a backlog would be the mirror's queue, not its upload
                one1 = res.get("one.s3_1", {}).get("samples_raw")
                guess = statistics.median(s["seconds"] for s in one1) if one1 else gen_bytes / (conn_bps or 1e9)
                step_ms = 1000 * 1.5 * guess / a.every
                note(f"single.s3: 1 node x {NODES * RANKS} ranks, shared folder, rank 0's mirror uploads")
                res["single.s3"] = run_single(a, scratch / "single-s3", f"s3://{bucket}/runs/single", s3env[0], step_ms)
                res["single.s3"]["step_ms"] = round(step_ms)
                prog.advance(task)
            note("done")
    finally:
        for u in ups:
            u.close()
        moto.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    # ---------------------------------------------------------------- figures
    methods: dict[str, Any] = {}
    for k in ("nodes.s3", "nodes.file", "single.s3"):
        if k in res:
            methods[k] = stats([s["seconds"] for s in res[k]["saves"]])
    for k in ("one.s3", "one.file"):
        for t in (MAX_PARALLEL_UPLOADS, 1):
            if f"{k}_{t}" in res:
                methods[f"{k}_{t}"] = stats([s["seconds"] for s in res[f"{k}_{t}"]["samples_raw"]])
    some = res.get("nodes.s3") or res.get("nodes.file")
    first = some["nodes"]
    state_bytes = sum(v["shard_bytes"] for v in first.values())
    small = first["0"]["extra_bytes"]
    measured = {
        "state_bytes": state_bytes, "small_bytes_node0": small,
        "bytes_per_node": {k: v["shard_bytes"] + v["extra_bytes"] for k, v in first.items()},
    }
    if "nodes.s3" in res:
        r0 = res["nodes.s3"]["saves"][-1]["requests"]
        measured["requests_per_save"] = {k: statistics.median(s["requests"][k] for s in res["nodes.s3"]["saves"])
                                         for k in ("objects", "parts", "listings_seen", "marker", "signature",
                                                   "total_commit", "other")}
        measured["requests_by_node"] = r0["by_node"]
        measured["wire_bytes_per_node_per_save"] = {
            k: round(v / res["nodes.s3"]["checkpoints"]) for k, v in res["nodes.s3"]["wire_bytes_per_node"].items()}
    inputs = {"conn_bps": link["conn_bps"], "latency_s": link["latency_s"], "disk_bps": link["disk_write_bps"],
              "uplink_bps": uplink_bps, "parallel": MAX_PARALLEL_UPLOADS, "threshold": MULTIPART_THRESHOLD,
              "part": PART_SIZE}
    model_here = paper(nodes=NODES, ranks=RANKS, state=state_bytes, small=small, **inputs)
    model_64 = paper(nodes=a.paper_nodes, ranks=a.paper_ranks, state=12 * a.paper_params, small=small, **inputs)
    model_64_here = paper(nodes=a.paper_nodes, ranks=a.paper_ranks, state=state_bytes, small=small, **inputs)
    check = []  # the model at 2 x 2 beside what was measured (docs: benchmarks/README.md, "Multi-node commit")
    if "nodes.s3" in methods and "nodes.file" in methods:
        check.append({"figure": "nodes.s3 - nodes.file: the store's share of a per-node save",
                      "measured": methods["nodes.s3"]["median"] - methods["nodes.file"]["median"],
                      "model": model_here["per_node"]["store_s"]})
    for t in (MAX_PARALLEL_UPLOADS, 1):
        if f"one.s3_{t}" in methods:
            check.append({"figure": f"one.s3_{t}: one uploader, {t} thread(s), upload + marker",
                          "measured": methods[f"one.s3_{t}"]["median"], "model": model_here["rank0"][t]["store_s"]})
    if "single.s3" in methods:
        check.append({"figure": "single.s3 minus its local save: the mirror's upload",
                      "measured": statistics.median(x["seconds"] - x["local_commit"] for x in res["single.s3"]["saves"]),
                      "model": model_here["rank0"][1]["store_s"]})
    doc = {
        "benchmark": "bench_nodes", "schema": "ripresa-bench-nodes/1",
        "command": "benchmarks/bench_nodes.py " + " ".join(sys.argv[1:]),
        "width": a.width, "saves": a.saves, "every": a.every,
        "store": {"server": "moto S3 server on 127.0.0.1, one proxy per node", "conn_mbps": a.conn_mbps,
                  "uplink_mbps": a.uplink_mbps, "latency_ms": a.latency_ms},
        "link_measured": link, "methods": methods, "measured": measured, "raw": res,
        "paper": {"inputs": inputs, "inputs_from": "measured here: one connection's bandwidth and a small PUT's "
                  "round trip through an idle node proxy, a 64 MiB write+fsync of the scratch disk",
                  "here_2x2": model_here, "check_2x2": check, "nodes_64": model_64, "nodes_64_this_state": model_64_here},
        "machine": {"cpus": os.cpu_count(), "load_average_start": [round(x, 2) for x in load0],
                    "load_average_end": [round(x, 2) for x in os.getloadavg()],
                    "python": platform.python_version(), "platform": platform.platform(),
                    "wall_s": round(time.time() - t_start, 1)},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / (f"bench_nodes_{a.width}" + (f"_uplink{a.uplink_mbps:g}" if a.uplink_mbps else "") + ".json")
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")

    t = Table(title=f"save-to-commit, {state_bytes / MB:.1f} MB state (seconds)")
    for c in ("alternative", "median", "min", "max", "n"):
        t.add_column(c, justify="left" if c == "alternative" else "right")
    for k, m in methods.items():
        t.add_row(k, f"{m['median']:.3f}", f"{m['min']:.3f}", f"{m['max']:.3f}", str(len(m["samples"])))
    console.print(t)
    console.print(f"link: {link['conn_bps'] / MB:.1f} MB/s per connection, {link['latency_s'] * 1000:.1f} ms per "
                  f"request, disk {link['disk_write_bps'] / MB:.0f} MB/s")
    if "requests_per_save" in measured:
        console.print(f"per save: bytes per node {measured['bytes_per_node']}, on the wire "
                      f"{measured['wire_bytes_per_node_per_save']}; requests {measured['requests_per_save']}")
    p = Table(title=f"on paper: {a.paper_nodes} nodes x {a.paper_ranks} ranks, {12 * a.paper_params / 1e9:.0f} GB")
    for c in ("", "bytes/node", "requests", "latency s"):
        p.add_column(c, justify="left" if not c else "right")
    for name, m in (("here 2x2", model_here), (f"{a.paper_nodes}x{a.paper_ranks}", model_64)):
        p.add_row(f"{name} per node", f"{m['bytes_per_node'] / MB:.1f} MB", str(m["requests_per_save"]),
                  f"{m['per_node']['latency_s']:.2f}")
        for c, r in m["rank0"].items():
            p.add_row(f"{name} rank 0, {c} conn", f"{r['bytes_through_one_uplink'] / MB:.1f} MB",
                      str(m["requests_per_save"]), f"{r['latency_s']:.2f}")
    console.print(p)
    if check:
        c = Table(title="the model against this run (2 x 2, S3), seconds")
        for col in ("figure", "measured median", "model"):
            c.add_column(col, justify="left" if col == "figure" else "right")
        for row in check:
            c.add_row(row["figure"], f"{row['measured']:.3f}", f"{row['model']:.3f}")
        console.print(c)
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
