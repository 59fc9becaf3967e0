"""The mirror never wedges (docs/MIRROR.md "Outages"): a real S3 server (moto, 127.0.0.1) behind a real TCP fault proxy.

An outage is recorded once (``mirror_outage``, then ``mirror_recovered`` with the failed attempts), rounds back
off, everything pending is uploaded once the store is back, and ``close()`` is bounded even with the store down.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.helpers import PtyStderr, history_events
from support.mirror_train import train

from ripresa.store.history import HISTORY_NAME, History, read_history
from ripresa.store.mirror import Mirror, MirrorSpec, local_generations
from ripresa.store.retention import KeepLast

pytest_plugins = ["support.s3fixtures"]  # the fixtures moto, s3, proxy

MIRROR_TRAIN = Path(__file__).resolve().parent / "support" / "mirror_train.py"
#: The mirror events an outage may write (the per-generation ones, uploaded/skipped/retention, are not outage noise).
OUTAGE_EVENTS = ("mirror_retry", "mirror_outage", "mirror_recovered", "mirror_error", "mirror_pending")


def outage_lines(run: Path) -> list[dict]:
    return [e for e in read_history(run / HISTORY_NAME).events if e.get("event") in OUTAGE_EVENTS]


def fast(url: str, **kw) -> MirrorSpec:
    return MirrorSpec(url, **{"timeout": 1.0, "attempts": 3, "backoff": 0.02, "max_backoff": 0.2, "close_timeout": 30.0,
                              **kw})


def test_an_outage_is_recorded_once_everything_is_uploaded_when_the_store_is_back(tmp_path, s3, proxy, capsys):
    run = tmp_path / "run"

    def outage() -> None:  # the store goes away once step 6 is in it
        while 6 not in s3.committed():
            time.sleep(0.01)
        proxy.mode = "down"
        proxy.drop_all()

    def back_after_15(step: int) -> None:
        """At step 15 the loop waits until the mirror has recorded the outage, then the store comes back: the
        outage is long enough to be one whatever the load (a blip the retries absorb is, rightly, no outage)."""
        if step != 15:
            return
        deadline = time.monotonic() + 120
        while not history_events(run, "mirror_outage") and time.monotonic() < deadline:
            time.sleep(0.02)
        proxy.mode = "pass"

    t = threading.Thread(target=outage, daemon=True)
    t.start()
    out = train(run, 24, 3, mirror=fast(s3.url), sleep=0.01, after_step=back_after_15)
    t.join(timeout=60)
    assert out["step"] == 24
    # recorded once: one outage, one recovery with the count; no per-round failure lines (the old wedge wrote
    # `mirror_failed KeyError` lines by the thousand)
    lines = outage_lines(run)
    print(lines)
    assert [e["event"] for e in lines if e["event"] != "mirror_retry"] == ["mirror_outage", "mirror_recovered"]
    assert len(lines) <= 2 + fast("").attempts  # the retries of the round that gave up, then one line each
    rec = history_events(run, "mirror_recovered")[0]
    assert rec["failed_attempts"] >= 1 and rec["seconds"] > 0 and rec["uploaded"], rec
    # nothing lost: the remote policy (twice keep_last=3) holds the newest six, byte for byte the local markers
    assert s3.committed() == [9, 12, 15, 18, 21, 24]
    for name in local_generations(run):
        assert s3.get(name + ".sha256") == (run / (name + ".sha256")).read_bytes()
    err = capsys.readouterr().err
    assert err.count("cannot be reached") == 1 and err.count("reachable again") == 1, err


def long_outage(tmp_path: Path, s3, proxy, capsys, seconds: float) -> dict:
    """A Mirror whose store is down for ``seconds`` with a fast back-off (a round every ~0.05 s: 20 rounds a second,
    as many as an outage of ``seconds`` x 600 s at the default 30 s cap), commits waking it meanwhile; then the close
    with the store still down. Returns the rounds, the history growth and the close's duration."""
    run = tmp_path / "run"
    train(run, 6, 3, mirror=fast(s3.url))
    assert s3.committed() == [3, 6]
    proxy.mode = "down"
    hist = History(run / HISTORY_NAME)
    size0 = (run / HISTORY_NAME).stat().st_size
    lines0 = len((run / HISTORY_NAME).read_bytes().splitlines())
    m = Mirror(fast(s3.url, backoff=0.001, max_backoff=0.01), run, local_retention=KeepLast(3), event=hist.event)
    train(tmp_path / "more", 9, 3)  # a newer generation the store lacks
    for suffix in ("", ".json", ".sha256"):
        os.replace(tmp_path / "more" / f"step_000009.safetensors{suffix}", run / f"step_000009.safetensors{suffix}")
    try:
        m.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:  # an "outage of hours" in rounds: commits keep waking the thread too
            m.notify()
            time.sleep(0.02)
        rounds = m._rounds
        assert m.in_outage and m.pending == [3, 6, 9]  # it could not even list the store
        data = (run / HISTORY_NAME).read_bytes()
        grown = {"rounds": rounds, "bytes": len(data) - size0, "lines": len(data.splitlines()) - lines0}
        # the close with the store still down: one more round (each request tried once), then it leaves
        t1 = time.monotonic()
        assert m.close() is False
        grown["close_s"] = round(time.monotonic() - t1, 3)
    finally:
        hist.close()
    with capsys.disabled():
        print(f"\noutage of {seconds} s: {grown}")
    assert [e["event"] for e in outage_lines(run)] == ["mirror_outage", "mirror_pending"]  # O(1), whatever the rounds
    assert grown["lines"] <= 2 and grown["bytes"] < 2000
    assert grown["close_s"] < 20  # a hang guard; it leaves after one round
    assert history_events(run, "mirror_pending")[0]["steps"] == [3, 6, 9]
    err = capsys.readouterr().err
    assert f"ripresa mirror push {run}" in err and "left step(s) 3, 6, 9 pending" in err
    assert err.count("training goes on") == 1  # the outage said once on stderr
    proxy.mode = "pass"  # nothing was lost: the push uploads it
    from ripresa.cli import main as cli_main

    assert cli_main(["mirror", "push", str(run)]) == 0
    assert s3.committed() == [3, 6, 9]
    return grown


def test_a_long_outage_with_fast_back_off_keeps_the_history_small_and_close_is_bounded(tmp_path, s3, proxy, capsys):
    assert long_outage(tmp_path, s3, proxy, capsys, 2.0)["rounds"] >= 15


@pytest.mark.slow
def test_an_outage_of_thousands_of_rounds_adds_two_history_lines(tmp_path, s3, proxy, capsys):
    seconds = float(os.environ.get("RIPRESA_OUTAGE_S", "60"))
    assert long_outage(tmp_path, s3, proxy, capsys, seconds)["rounds"] >= 10 * seconds


@pytest.mark.slow
def test_sigterm_with_the_store_down_exits_in_seconds_naming_the_pending_steps(tmp_path, s3, proxy):
    """`time from SIGTERM to exit` with the store down: a few seconds plus the final save (docs/MIRROR.md)."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.Popen([sys.executable, str(MIRROR_TRAIN), "--run", str(run), "--steps", "100000", "--every", "5",
                             "--mirror", s3.url, "--sleep", "0.02", "--timeout", "2", "--backoff", "0.2",
                             "--close-timeout", "600"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while 5 not in s3.committed():
            assert proc.poll() is None and time.time() - t0 < 120
            time.sleep(0.05)
        proxy.mode = "down"
        proxy.drop_all()
        n = len(local_generations(run))
        while len(local_generations(run)) < n + 3:  # three saves with the store down
            assert proc.poll() is None and time.time() - t0 < 240
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"SIGTERM to exit: {took:.2f} s\n{err[-2000:]}")
    assert proc.returncode == 0, err[-3000:]
    assert took < 30  # close_timeout is 600 s: the outage, not the budget, ends the close
    pending = history_events(run, "mirror_pending")[-1]
    assert pending["steps"] and f"ripresa mirror push {run}" in err
    assert len(outage_lines(run)) <= 12
    proxy.mode = "pass"
    last = json.loads(out.strip().splitlines()[-1])["step"]
    from ripresa.cli import main as cli_main

    assert cli_main(["mirror", "push", str(run)]) == 0
    assert last in s3.committed()


@pytest.mark.slow
def test_a_second_sigterm_during_a_slow_close_leaves_at_once(tmp_path, s3, proxy):
    """On a terminal the close shows its progress with the Ctrl-C hint; a second SIGTERM during it leaves at once."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    tty = PtyStderr()  # stderr is a terminal
    proc = subprocess.Popen([sys.executable, str(MIRROR_TRAIN), "--run", str(run), "--steps", "100000", "--every", "5",
                             "--mirror", s3.url, "--sleep", "0.02", "--timeout", "30", "--close-timeout", "600"],
                            env=env, stdout=subprocess.PIPE, stderr=tty.slave, text=True)
    tty.start()
    try:
        t0 = time.time()
        while 5 not in s3.committed():
            assert proc.poll() is None and time.time() - t0 < 120
            time.sleep(0.05)
        proxy.slow_bps = 1000  # uploads crawl: the stop's generation takes many seconds
        proxy.drop_all()
        proc.send_signal(signal.SIGTERM)  # the first: stop, save, close (which waits for the upload)
        while "Ctrl-C to leave them pending" not in tty.text():
            assert proc.poll() is None and time.time() - t0 < 240
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proxy.slow_bps = None
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        tty.close()
    err = tty.text()  # the progress line wraps its text under the numbers at 80 columns
    print(f"second SIGTERM to exit: {took:.2f} s\n{err[-2000:]}")
    assert proc.returncode == 0, err[-3000:]
    assert took < 15
    assert "ripresa: mirror: uploading step" in err and "pending) — Ctrl-C to leave them pending and exit" in err
    assert re.search(r"\d+/\d+ uploaded", err), err[-2000:]  # generations uploaded of those pending (ripresa.console)
    assert history_events(run, "mirror_pending")[-1]["reason"] == "interrupted"  # its steps, or the run's files still in flight
    assert "ripresa: mirror: left " in err and f"ripresa mirror push {run}" in err
