"""Multi-node runs on node-local folders, each generation committed through the store (docs/DISTRIBUTED.md).

Every "node" is its own ``torchrun --nnodes N --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT`` launcher with
its own run folder, never visible to the other node (tests/support/nodes.py); the store is a folder or the S3
test server. A launch of two nodes costs ~8 s on 2 cores: the default tier runs one two-launcher, two-folder
sample (a save, a resume); the rest (bitwise equality with an uninterrupted run, 4 → 2 → 4 ranks counting
sample ids, a node lost mid-run, a node killed mid-upload, DDP, S3) is ``slow`` (``make test-long``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from support.nodes import DIST_LOOP, FSDP_LOOP, launch, ok, run_nodes
from support.ripresa_faults import fault_env

pytest_plugins = ["support.s3fixtures"]

STORE_FILES = ("__0_0.distcp", "__1_0.distcp")


def events(run: Path, name: str) -> list[dict]:
    out = []
    for line in (run / ".loss.jsonl").read_text().splitlines():
        doc = json.loads(line)
        if doc.get("event") == name:
            out.append(doc)
    return out


def marker_lines(raw: bytes) -> dict[str, str]:
    out = {}
    for line in raw.decode().splitlines():
        sha, name = line.split("  ", 1)
        out[name] = sha
    return out


def check_store_generation(store: Path, main: str) -> dict[str, str]:
    """The store's marker vouches for every object of ``main`` (``sha256sum -c`` from the store's folder)."""
    hashes = marker_lines((store / (main + ".sha256")).read_bytes())
    assert {n.split("/", 1)[1] for n in hashes} == {p.name for p in (store / main).iterdir()}
    for name, sha in hashes.items():
        assert hashlib.sha256((store / name).read_bytes()).hexdigest() == sha, name
    return hashes


def fsdp_args(store: Path, steps: int, every: int = 3, *extra: str) -> list[str]:
    return ["--steps", str(steps), "--every", str(every), "--mirror", str(store), *extra]


def test_two_nodes_commit_each_generation_through_the_store_and_resume(tmp_path):
    """The sample of the default tier: two launchers, two folders, one store; each node uploads its own part,
    the marker names every object, each node keeps only its part, and a restart of both nodes resumes."""
    store = tmp_path / "store"
    nodes = run_nodes(tmp_path, 2, FSDP_LOOP, fsdp_args(store, 6))
    ok(nodes)
    hashes = check_store_generation(store, "step_000006.dcp")
    assert set(hashes) == {f"step_000006.dcp/{n}" for n in (*STORE_FILES, ".metadata", "ripresa.json")}
    for k, node in enumerate(nodes):
        part = node.run / "step_000006.dcp"
        # its own ranks' shards only; companion and .metadata on every node; the store's very marker
        assert sorted(p.name for p in part.iterdir()) == sorted([f"__{k}_0.distcp", ".metadata", "ripresa.json"])
        assert (node.run / "step_000006.dcp.sha256").read_bytes() == (store / "step_000006.dcp.sha256").read_bytes()
        assert (part / f"__{k}_0.distcp").read_bytes() == (store / f"step_000006.dcp/__{k}_0.distcp").read_bytes()
    assert not (nodes[1].run / "step_000006.dcp" / "__0_0.distcp").exists()
    assert not (nodes[1].run / ".loss.jsonl").exists()  # one history: rank 0's
    assert (store / "step_000003.dcp.sha256").exists()

    again = run_nodes(tmp_path, 2, FSDP_LOOP, fsdp_args(store, 9))
    ok(again)
    pulled = events(nodes[0].run, "nodes_pulled")[-1]
    assert pulled["step"] == 6 and set(pulled["nodes"]) == {"0", "1"}
    # a restart on the same machines reads each node's own part: no node fetched its own shards
    assert all(v["bytes"] < 2 * (store / "step_000006.dcp" / "__0_0.distcp").stat().st_size for v in pulled["nodes"].values())
    assert "resumed step_000006.dcp from the store" in again[0].out
    resume = events(nodes[0].run, "resume")[-1]
    assert resume["from_step"] == 6 and resume["world_size"] == 2
    check_store_generation(store, "step_000009.dcp")


def test_nodes_without_a_shared_folder_need_a_store(tmp_path):
    """Node-local folders and no mirror: refused on every rank before anything is written (exit 2 in the rank)."""
    nodes = run_nodes(tmp_path, 2, FSDP_LOOP, ["--steps", "3", "--every", "3"])
    for n in nodes:  # every node's rank refuses, in its own paragraph, with exit 2 (the rank's, not torchrun's
        # summary: when the other node's agent hosted the rendezvous store and left first, the agent reports that)
        assert n.proc.returncode != 0
        assert "do not share the run folder, and no store joins them" in n.out, n.out[-2000:]
        assert "ripresa.errors.BadInput, exit 2" in n.out, n.out[-2000:]
        assert not list(n.run.glob("step_*"))


# ---------------------------------------------------------------------------- slow: make test-long


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted two-node run to step 12: the store's shards of step 12."""
    root = tmp_path_factory.mktemp("ref")
    ok(run_nodes(root, 2, FSDP_LOOP, fsdp_args(root / "store", 12)))
    return {n: (root / "store" / "step_000012.dcp" / n).read_bytes() for n in STORE_FILES}


def same_as_reference(store: Path, reference: dict[str, bytes]) -> None:
    check_store_generation(store, "step_000012.dcp")
    for name, data in reference.items():
        assert (store / "step_000012.dcp" / name).read_bytes() == data, name


@pytest.mark.slow
def test_an_interrupted_two_node_run_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path, reference):
    store = tmp_path / "store"
    ok(run_nodes(tmp_path, 2, FSDP_LOOP, fsdp_args(store, 6)))
    ok(run_nodes(tmp_path, 2, FSDP_LOOP, fsdp_args(store, 12)))
    same_as_reference(store, reference)


@pytest.mark.slow
def test_a_lost_node_stops_the_survivors_and_a_fresh_node_resumes_from_the_store(tmp_path, reference):
    """SIGKILL one node's launcher and delete its folder mid-run: the survivor stops within a bound, exit 4 in
    its rank, a message naming the lost node; a fresh node then resumes and the run ends bitwise equal."""
    store = tmp_path / "store"
    nodes = launch(tmp_path, 2, FSDP_LOOP, fsdp_args(store, 12, 3, "--step-ms", "400"))
    deadline = time.monotonic() + 120
    while not (store / "step_000003.dcp.sha256").exists():  # a generation is committed, training goes on
        assert time.monotonic() < deadline and nodes[0].proc.poll() is None, nodes[0].log.read_text()[-2000:]
        time.sleep(0.1)
    t0 = time.monotonic()
    nodes[1].kill()
    shutil.rmtree(nodes[1].run.parent)
    nodes[0].wait(60)
    took = time.monotonic() - t0
    assert nodes[0].proc.returncode != 0
    assert took < 30, took
    assert "lost node 1" in nodes[0].out and "NodeLost, exit 4" in nodes[0].out, nodes[0].out[-3000:]
    # (torchrun's own summary varies: when the lost node hosted the rendezvous store, the agent reports that)
    committed = sorted(p.name for p in store.glob("step_*.dcp.sha256"))
    assert committed and not (tmp_path / "node1").exists()

    ok(run_nodes(tmp_path, 2, FSDP_LOOP, fsdp_args(store, 12)))  # node 1 starts from nothing
    pulled = events(nodes[0].run, "nodes_pulled")[-1]
    assert pulled["nodes"]["1"]["objects"] >= 3  # companion, .metadata and its shards came from the store
    same_as_reference(store, reference)


@pytest.mark.slow
def test_a_node_killed_after_its_upload_leaves_the_previous_generation_the_newest(tmp_path, reference):
    """Rank 1 dies after its node uploaded its part of step 6, before the marker: step 6 never counts."""
    store = tmp_path / "store"
    nodes = run_nodes(tmp_path, 2, FSDP_LOOP, fsdp_args(store, 12),
                      env=fault_env(dist_fault="node_uploaded:1:6"))
    assert all(n.proc.returncode != 0 for n in nodes)
    assert (store / "step_000006.dcp" / "__1_0.distcp").exists()  # node 1's part is in the store ...
    assert not (store / "step_000006.dcp.sha256").exists()  # ... but step 6 was never committed
    assert (store / "step_000003.dcp.sha256").exists()
    ok(run_nodes(tmp_path, 2, FSDP_LOOP, fsdp_args(store, 12)))
    assert events(nodes[0].run, "resume")[-1]["from_step"] == 3
    same_as_reference(store, reference)


@pytest.mark.slow
def test_four_ranks_then_two_then_four_see_every_sample_once(tmp_path):
    """2 nodes × 2 ranks → 1 node × 2 → 2 × 2: DCP reshards the FSDP2 state and the data position carries
    across: counted by sample id, each sample of each epoch is seen exactly once."""
    store, ids = tmp_path / "store", tmp_path / "ids"
    common = ["--ids", str(ids)]
    ok(run_nodes(tmp_path, 2, FSDP_LOOP, fsdp_args(store, 6, 3, *common), nproc=2))
    ok(run_nodes(tmp_path, 1, FSDP_LOOP, fsdp_args(store, 18, 3, *common), nproc=2))  # node 0 alone
    ok(run_nodes(tmp_path, 2, FSDP_LOOP, fsdp_args(store, 30, 3, *common), nproc=2))
    seen: dict[int, Counter] = defaultdict(Counter)
    ranks_at: dict[int, set[int]] = defaultdict(set)
    for r in range(4):
        for line in (tmp_path / f"ids.{r}").read_text().splitlines():
            step, epoch, *rows = map(int, line.split())
            ranks_at[step].add(r)
            seen[epoch].update(rows)
    assert ranks_at[6] == {0, 1, 2, 3} and ranks_at[7] == {0, 1} and ranks_at[19] == {0, 1, 2, 3}
    assert sorted(seen) == [0, 1]
    for epoch, count in seen.items():
        assert sorted(count) == list(range(192)) and set(count.values()) == {1}, epoch
    changes = events(tmp_path / "node0" / "run", "world_size_change")
    assert [(c["saved_world_size"], c["world_size"]) for c in changes] == [(4, 2), (2, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["auto", "andrea"])
def test_ddp_nodes_keep_a_whole_copy_and_a_fresh_node_pulls_it(tmp_path, fmt):
    """DDP (general ``.safetensors`` and ``.bin``): every node's leader writes the whole, replicated generation
    into its own folder; rank 0's mirror uploads one copy; a node whose folder is lost pulls it whole."""
    store = tmp_path / "store"
    args = ["--every", "4", "--mirror", str(store), "--format", fmt]
    first = run_nodes(tmp_path, 2, DIST_LOOP, ["--steps", "8", *args])
    ok(first)
    suffix = ".bin" if fmt == "andrea" else ".safetensors"
    a, b = (n.run / f"step_000008{suffix}" for n in first)
    assert a.read_bytes() == (store / a.name).read_bytes()  # rank 0's copy is the store's
    if fmt == "auto":  # node 1's copy: the same weights and moments (its own top-level random streams: rank 1's)
        from safetensors.torch import load_file

        ta, tb = load_file(a), load_file(b)
        assert ta.keys() == tb.keys()
        same = [k for k in ta if not k.startswith("rng/")]
        assert same and all(ta[k].equal(tb[k]) for k in same)
    else:
        assert a.read_bytes() == b.read_bytes()  # weights, m, v only
    shutil.rmtree(first[1].run.parent)
    ok(run_nodes(tmp_path, 2, DIST_LOOP, ["--steps", "12", *args]))
    pulled = events(first[0].run, "nodes_pulled")[-1]
    assert pulled["nodes"]["0"]["bytes"] == 0 and pulled["nodes"]["1"]["bytes"] > 0
    straight = tmp_path / "straight"
    ok(run_nodes(straight, 2, DIST_LOOP, ["--steps", "12", "--every", "4", "--mirror", str(straight / "store"),
                                          "--format", fmt]))
    x, y = store / f"step_000012{suffix}", straight / "store" / f"step_000012{suffix}"
    if fmt == "andrea":
        assert x.read_bytes() == y.read_bytes()
    else:  # every tensor but Python's and NumPy's global streams, which dist_loop.py never seeds (each start draws them)
        from safetensors.torch import load_file

        tx, ty = load_file(x), load_file(y)
        keys = [k for k in tx if "rng/python" not in k and "rng/numpy" not in k]
        assert tx.keys() == ty.keys() and len(keys) > 10
        assert all(tx[k].equal(ty[k]) for k in keys), [k for k in keys if not tx[k].equal(ty[k])]


@pytest.mark.slow
def test_two_nodes_on_the_s3_server(tmp_path, reference, s3):
    """The same through the S3 test server: the store is the only shared place."""
    ok(run_nodes(tmp_path, 2, FSDP_LOOP, fsdp_args(s3.url, 6)))
    ok(run_nodes(tmp_path, 2, FSDP_LOOP, fsdp_args(s3.url, 12)))
    keys = s3.keys()
    assert "step_000012.dcp.sha256" in keys and "step_000006.dcp.sha256" in keys
    for name, data in reference.items():
        got = s3.client.get_object(Bucket=s3.bucket, Key=f"{s3.prefix}step_000012.dcp/{name}")["Body"].read()
        assert got == data, name


@pytest.mark.slow
def test_ripresa_verify_runs_a_two_launcher_script_with_its_own_launchers(tmp_path):
    """``ripresa verify -- ./nodes.sh``: the script starts both nodes' torchrun; every rank is steered into the
    verify folders (the run's own folders and store are never touched) and every check passes at tolerance 0."""
    import os
    import stat
    import subprocess
    import sys

    from support.nodes import ENV

    script = tmp_path / "nodes.sh"
    port = f'$("{sys.executable}" -c "from support.nodes import free_port; print(free_port())")'
    script.write_text(f"""#!/bin/sh
P={port}
for n in 0 1; do
  "{sys.executable}" -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
    --rdzv-endpoint 127.0.0.1:$P --rdzv-id v -- "{FSDP_LOOP}" --run "{tmp_path}/n$n/run" \\
    --mirror "{tmp_path}/store" "$@" &
done
wait
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "verify"
    r = subprocess.run([sys.executable, "-m", "ripresa", "verify", "--output", str(out), "--steps", "6", "--cut", "3",
                        "--tolerance", "0", "--json", "--", str(script), "--steps", "6", "--every", "3"],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, **ENV, "PYTHONPATH": str(Path(__file__).parent)})
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "verification.json").read_text())
    assert report["all_checks_passed"] is True
    assert not (tmp_path / "n0").exists() and not (tmp_path / "store").exists()


@pytest.mark.slow
def test_ripresa_train_shard_fsdp_on_two_nodes_and_a_lost_folder(tmp_path):
    """``torchrun ... -m -- ripresa train --shard fsdp --mirror URL`` on two nodes; node 1's folder lost; the
    same command again resumes from the store and goes on."""
    store = tmp_path / "store"
    args = ["--config", "tiny", "--every", "5", "--shard", "fsdp", "--mirror", str(store)]
    first = run_nodes(tmp_path, 2, "-mripresa train", ["--steps", "10", *args])
    ok(first)
    check_store_generation(store, "step_000010.dcp")
    assert sorted(p.name for p in (first[1].run / "step_000010.dcp").glob("*.distcp")) == ["__1_0.distcp"]
    shutil.rmtree(first[1].run.parent)
    again = run_nodes(tmp_path, 2, "-mripresa train", ["--steps", "15", *args])
    ok(again)
    check_store_generation(store, "step_000015.dcp")
    pulled = events(first[0].run, "nodes_pulled")[-1]
    assert pulled["step"] == 10 and pulled["nodes"]["1"]["objects"] >= 3
