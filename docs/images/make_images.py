"""Remake plot.png and compare.png of the README from a short, real tiny run (CPU, ~30 s).

    python docs/images/make_images.py [WORK_DIR]

tiny-300: 300 steps, checkpoint every 50, a SIGUSR1 near step 80 (checkpoint and
go on), a SIGKILL near step 190 (the last checkpoint is 150), then
`ripresa train` on the same folder resumes at 150 and finishes. Two audit forks
of its step 200 train 200 more steps each, with lr 0.03 and 0.003.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ripresa.store.history import HISTORY_NAME, History, read_history
from ripresa.engine.plots import compare_runs, plot_run

HERE = Path(__file__).resolve().parent
FAST = ["--config", "tiny", "--quiet", "--threads", "1", "--no-audit", "--set", "train.batch_size=8"]


def train(*args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ripresa", "train", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_step(run: Path, step: int, proc: subprocess.Popen) -> None:
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"train exited early: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        h = run / HISTORY_NAME
        if h.exists() and max(read_history(h).steps, default=0) >= step:
            return
        time.sleep(0.02)


def done(proc: subprocess.Popen) -> None:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(out + err)


def main() -> None:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="ripresa-images-"))
    run = work / "tiny-300"
    shutil.rmtree(run, ignore_errors=True)
    p = train("--run", run, *FAST, "--steps", 300, "--every", 50)
    wait_step(run, 80, p)
    p.send_signal(signal.SIGUSR1)
    wait_step(run, 190, p)
    p.send_signal(signal.SIGKILL)  # a crash: steps 151..190 are lost and run again
    p.wait()
    done(train("--run", run, *FAST, "--steps", 150, "--every", 50))
    forks = []
    for lr in ("0.03", "0.003"):
        fork = work / f"fork-lr{lr}"
        shutil.rmtree(fork, ignore_errors=True)
        h = History(fork / HISTORY_NAME)
        h.event("fork", parent=str(run), parent_step=200, parent_file="step_000200.bin", set={"train.lr": float(lr)})
        h.close()
        forks.append(fork)
        done(train("--run", fork, "--resume", run / "step_000200.bin", *FAST, "--set", f"train.lr={lr}",
                   "--steps", 200, "--every", 50))
    print(plot_run(run, HERE / "plot.png"))
    print(compare_runs(forks, HERE / "compare.png")["png"])


if __name__ == "__main__":
    main()
