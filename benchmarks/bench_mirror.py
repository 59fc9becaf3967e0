"""Time from a blank run folder to the first resumed step, from an S3 mirror (docs/MIRROR.md).

    .venv/bin/python benchmarks/bench_mirror.py --config andrea-12m --samples 3

Starts a real S3 server (moto, a dev dependency) on 127.0.0.1, trains one step
of ``ripresa train --config CONFIG --mirror s3://...`` so the store holds one
generation and ``config.json``, then, ``--samples`` times, runs
``ripresa train --run BLANK --mirror s3://... --steps 1`` in a fresh process on
a new, empty folder (no ``--config``: it comes from the mirror) and reads the
run's history: the seconds from the process start to the generation pulled
and committed locally (``mirror_pulled``), to the state restored
(``resume``) and to the first resumed step done. Writes
``benchmarks/results/bench_mirror_<config>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def history(run: Path) -> list[dict]:
    out = []
    for line in (run / ".loss.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="andrea-12m")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    a = ap.parse_args()

    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = dict(os.environ, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_CONFIG_FILE="/nonexistent",
               AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_EC2_METADATA_DISABLED="true", PYTHONDONTWRITEBYTECODE="1")
    scratch = Path(tempfile.mkdtemp(prefix="bench-mirror-", dir=a.dir))
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        bucket = "bench-" + uuid.uuid4().hex[:8]
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                     aws_access_key_id="bench", aws_secret_access_key="bench").create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/runs/{a.config}"
        common = ["--no-audit", "--quiet", "--threads", str(a.threads), "--device", "cpu"]
        cli = [sys.executable, "-m", "ripresa", "train"]
        t0 = time.time()
        src = scratch / "source"
        r = subprocess.run([*cli, "--run", str(src), "--config", a.config, "--steps", "1", "--every", "1", "--mirror", url,
                            *common], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            return 2
        seeded = time.time() - t0
        up = [e for e in history(src) if e.get("event") == "mirror_uploaded"]
        gen_bytes = sum(p.stat().st_size for p in src.glob("step_000001.*") if p.is_file())
        samples = []
        for i in range(a.samples):
            blank = scratch / f"new-machine-{i}"
            t0 = time.time()
            r = subprocess.run([*cli, "--run", str(blank), "--mirror", url, "--steps", "1", "--every", "0", *common],
                               env=env, capture_output=True, text=True)
            wall = time.time() - t0
            if r.returncode != 0:
                print(r.stderr[-3000:], file=sys.stderr)
                return 2
            h = history(blank)
            pulled = next(e for e in h if e.get("event") == "mirror_pulled")
            resumed = next(e for e in h if e.get("event") == "resume")
            step = next(e for e in h if "event" not in e and e.get("step") == 2)
            samples.append({"pulled_s": round(pulled["time"] - t0, 3), "resumed_s": round(resumed["time"] - t0, 3),
                            "first_step_s": round(step["time"] - t0, 3), "process_s": round(wall, 3)})
            print(f"sample {i + 1}: pulled {samples[-1]['pulled_s']} s, resumed {samples[-1]['resumed_s']} s, "
                  f"first step {samples[-1]['first_step_s']} s, process {samples[-1]['process_s']} s")
            shutil.rmtree(blank)
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    doc = {
        "benchmark": "bench_mirror", "config": a.config, "store": "moto S3 server on 127.0.0.1 (boto3)",
        "command": f"ripresa train --run BLANK --mirror {url} --steps 1 --every 0 {' '.join(common)}",
        "generation_bytes": gen_bytes, "first_upload": up[0] if up else None, "seed_run_s": round(seeded, 3),
        "samples": samples,
        "median": {k: round(statistics.median(s[k] for s in samples), 3) for k in samples[0]},
        "machine": {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
                    "python": platform.python_version(), "platform": platform.platform()},
        "note": "seconds from the process start; pulled = generation downloaded, verified and committed locally",
    }
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"bench_mirror_{a.config}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"median: {doc['median']}  ({gen_bytes / 1e6:.1f} MB generation) -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
