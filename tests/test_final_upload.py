"""A normal end never reports success with the final state left behind (docs/MIRROR.md "The close", "Commands").

Against a real S3 server (moto on 127.0.0.1) behind a real TCP fault proxy (tests/support/s3server.py) and a
real local-path mirror:

* the store down at a normal end: the close waits for it, with progress, and when it comes back within the
  bound the final generation is uploaded (a pull verifies it) and ``close()`` says "safe off the machine";
* the store down beyond a short ``--final-upload-timeout``: ``ripresa train`` exits 3 with the line naming
  ``ripresa mirror push RUN``, and that command, typed afterwards with the store up, uploads it;
* SIGTERM with the store down keeps its short bound (exit within seconds, 3: the upload is pending), and a
  SIGTERM during a normal end's wait leaves it at once (a SIGUSR1 does not);
* ``mirror status`` lists exactly what ``mirror push`` then uploads: a generation partly in the store, a
  damaged local one, ones the mirror's retention does not keep;
* the Lightning and Hugging Face callbacks report pending and safe (slow: their imports);
* a normal end never waits past the deadline, and on a terminal the wait shows the store, what is pending and
  the time left (slow).

Default tier: everything but the callbacks, the deadline and the terminal.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from support.helpers import PtyStderr, history_events
from support.mirror_train import train

import ripresa
from ripresa.cli import main as cli_main
from ripresa.errors import UploadPending
from ripresa.session.closing import CloseResult, close_plan
from ripresa.store.mirror import MirrorSpec, local_generations

pytest_plugins = ["support.s3fixtures"]  # the fixtures moto, s3, proxy

REPO = Path(__file__).resolve().parent.parent
GPT = ["--config", "tiny", "--no-audit", "--sync", "--quiet", "--threads", "1", "--device", "cpu"]


def fast(url: str, **kw) -> MirrorSpec:
    return MirrorSpec(url, **{"timeout": 1.0, "attempts": 2, "backoff": 0.05, "max_backoff": 0.5, **kw})


def loop(run: Path, steps: int, every: int, mirror, *, after_step=None, before_close=None,
         **checkpointer) -> tuple[ripresa.Checkpointer, CloseResult]:
    """A small real training loop through the public API; returns the session and what ``close()`` returned."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = ripresa.TrainingState(model=model, optimizer=opt, config={"steps": steps})
    ckpt = ripresa.Checkpointer(run, state, every=every, mirror=mirror, **checkpointer)
    x = torch.randn(32, 8)
    start = ckpt.resume()
    for step in range(start + 1, steps + 1):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ckpt.step_done(step, loss=loss.item()):
            break
        if after_step is not None:
            after_step(ckpt, step)
    if before_close is not None:
        before_close(ckpt)
    return ckpt, ckpt.close()


def down_before(proxy, s3, step: int, every: int):
    """An ``after_step`` hook: once step ``step - 1`` is done and generation ``step - every`` is in the store, the
    store goes away (generation ``step`` is never uploaded during the loop)."""
    def hook(ckpt, done: int) -> None:
        if done == step - 1:
            t0 = time.monotonic()
            while step - every not in s3.committed():  # (drain: the loop thread, blocked here, notifies no commit)
                assert time.monotonic() - t0 < 60
                ckpt.mirror.drain(1.0)
            proxy.mode = "down"
            proxy.drop_all()
    return hook


# ---------------------------------------------------------------------------- the normal end waits


def test_a_normal_end_waits_for_the_store_and_uploads_the_final_generation_when_it_is_back(tmp_path, s3, proxy, capsys):
    run = tmp_path / "run"
    came_back: list[float] = []

    def back_later(ckpt) -> None:  # the store comes back 1.5 s into the close
        def later() -> None:
            time.sleep(1.5)
            came_back.append(time.monotonic())
            proxy.mode = "pass"
        threading.Thread(target=later, daemon=True).start()

    t0 = time.monotonic()
    ckpt, result = loop(run, 6, 3, fast(s3.url), after_step=down_before(proxy, s3, 6, 3), before_close=back_later,
                        handle_signals=False, final_upload_timeout=30)
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    print(err, result)
    # it waited (instead of giving up after one round) and said so: the store, what is pending, the bound
    assert result.safe_off_machine and not result.upload_pending and result.exit_code == 0, result
    assert ckpt.upload_pending == [] and result.step == 6 and result.seconds >= 1.0
    print(f"normal end, store back 1.5 s into the close: close waited {result.seconds} s")
    assert came_back and took < 30
    assert re.search(r"ripresa: mirror: \S+ cannot be reached .*; waiting up to 0:30 to upload step\(s\) 6 \(\d", err), err
    assert "uploaded step(s) 6" in err and "left step" not in err
    wait = history_events(run, "mirror_final_wait")
    assert len(wait) == 1 and wait[0]["steps"] == [6] and wait[0]["bytes"] > 0 and wait[0]["bound_s"] == 30
    assert 6 in history_events(run, "mirror_recovered")[-1]["uploaded"]
    # the final generation is in the store: a pull into a blank folder lands it, verified, bitwise the local one
    assert 6 in s3.committed()
    assert cli_main(["mirror", "pull", str(tmp_path / "blank"), "--mirror", s3.url]) == 0
    name = "step_000006.safetensors"
    assert (tmp_path / "blank" / name).read_bytes() == (run / name).read_bytes()


def test_a_stop_signal_leaves_the_wait_at_once_a_checkpoint_signal_does_not(tmp_path, s3, proxy, capsys):
    run = tmp_path / "run"
    sent: dict[str, float] = {}
    senders: list[threading.Thread] = []

    def signals_later(ckpt) -> None:
        def later() -> None:
            time.sleep(0.7)
            os.kill(os.getpid(), signal.SIGUSR1)  # `ripresa signal RUN checkpoint` during the wait: it goes on
            sent["usr1"] = time.monotonic()
            time.sleep(1.0)
            sent["term"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)  # an operator's stop: leave now, the upload pending
        senders.append(threading.Thread(target=later, daemon=True))
        senders[-1].start()

    late: list[int] = []  # a signal after the session gave its handlers back (a close that did not wait) lands here
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: late.append(signum))
    try:
        ckpt, result = loop(run, 4, 2, fast(s3.url), after_step=down_before(proxy, s3, 4, 2),
                            before_close=signals_later, handle_signals=True, final_upload_timeout=60)
        left = time.monotonic()
    finally:
        for t in senders:
            t.join(timeout=10)
        signal.signal(signal.SIGTERM, previous)
    assert not late
    err = capsys.readouterr().err
    print(err, result)
    assert result.upload_pending and result.pending == (4,) and result.exit_code == 3, result
    assert result.reason == "interrupted" and "term" in sent
    assert sent["term"] <= left < sent["term"] + 5  # the SIGUSR1 did not end the wait; the SIGTERM did, at once
    assert f"ripresa mirror push {run}" in err and "left step(s) 4 pending (interrupted)" in err
    assert history_events(run, "mirror_pending")[-1]["steps"] == [4]
    with pytest.raises(UploadPending) as info:
        result.raise_if_pending()
    assert info.value.exit_code == 3 and f"ripresa mirror push {run}" in info.value.hint


def test_the_final_wait_is_bounded_by_the_option_and_by_the_deadline():
    now = 1_000_000.0
    assert close_plan(900.0, None, stopped=False, deadline=None, now=now) == (900.0, True, "final_upload_timeout")
    assert close_plan(900.0, 5.0, stopped=False, deadline=None, now=now) == (5.0, True, "final_upload_timeout")
    assert close_plan(900.0, 600.0, stopped=False, deadline=now + 42.0, now=now) == (42.0, True, "the deadline")
    assert close_plan(900.0, 600.0, stopped=False, deadline=now - 5.0, now=now) == (0.0, True, "the deadline")
    assert close_plan(900.0, 600.0, stopped=True, deadline=None, now=now) == (900.0, False, "close_timeout")
    assert MirrorSpec("/x").close_timeout == 900.0  # the documented default (docs/MIRROR.md, "The close")


# ---------------------------------------------------------------------------- ripresa train: exit 3


def _first_push_command(err: str) -> list[str]:
    m = re.search(r"`(ripresa mirror push [^`]+)`", err)
    assert m, err[-3000:]
    return shlex.split(m.group(1))


def test_ripresa_train_exits_3_when_the_store_stays_down_and_the_push_it_names_uploads_it(tmp_path, s3, proxy,
                                                                                          one_thread):
    run = tmp_path / "run"
    assert cli_main(["train", "--run", str(run), "--steps", "4", "--every", "2", "--mirror", s3.url, *GPT]) == 0
    assert 4 in s3.committed()
    proxy.mode = "down"  # from now on the store cannot be reached
    proxy.drop_all()
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "ripresa", "train", "--run", str(run), "--steps", "6", "--every", "2",
                          "--mirror", s3.url, "--final-upload-timeout", "2", *GPT], capture_output=True, text=True,
                         timeout=180, cwd=REPO)
    took = time.monotonic() - t0
    print(res.stdout, res.stderr, f"took {took:.1f} s")
    assert res.returncode == 3, res.stderr[-3000:]
    assert "done at step 6" in res.stdout
    assert "ripresa train: error: the run ended but its final generation is not in the mirror" in res.stderr
    assert f"ripresa mirror push {run} --mirror {s3.url}" in res.stderr
    pending = history_events(run, "mirror_pending")[-1]
    # (no listing succeeded this session: 2 and 4, in the store, count as pending too; the push finds them there)
    assert pending["steps"][-1] == 6 and "final_upload_timeout (2 s)" in pending["reason"], pending
    print(f"normal end, store down, --final-upload-timeout 2: waited {pending['seconds']} s, process {took:.1f} s")
    assert 2.0 <= pending["seconds"] < 10  # the bound, then it left
    assert history_events(run, "mirror_final_wait")[-1]["bound_s"] == 2
    assert 6 not in s3.committed()
    # the command the line names, typed afterwards with the store back, uploads it
    proxy.mode = "pass"
    cmd = _first_push_command(res.stderr)
    assert cmd[:3] == ["ripresa", "mirror", "push"]
    assert cli_main(cmd[1:]) == 0
    assert 6 in s3.committed()
    assert s3.get("step_000006.bin.sha256") == (run / "step_000006.bin.sha256").read_bytes()


def test_sigterm_with_the_store_down_keeps_its_short_bound(tmp_path, s3, proxy, one_thread):
    run = tmp_path / "run"
    assert cli_main(["train", "--run", str(run), "--steps", "2", "--every", "2", "--mirror", s3.url, *GPT]) == 0
    proxy.mode = "down"
    proxy.drop_all()
    proc = subprocess.Popen([sys.executable, "-m", "ripresa", "train", "--run", str(run), "--steps", "1000000",
                             "--every", "100000", "--mirror", s3.url, "--final-upload-timeout", "600", *GPT],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        t0 = time.monotonic()
        while not history_events(run, "mirror_outage") or len(history_events(run, "resume")) < 1:
            assert proc.poll() is None and time.monotonic() - t0 < 120, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"SIGTERM to exit with the store down: {took:.2f} s\n{err[-3000:]}")
    stopped = history_events(run, "mirror_pending")[-1]
    assert proc.returncode == 3, err[-3000:]  # done, the upload pending: not 0
    assert took < 15, took  # --final-upload-timeout 600 is not waited: a stop keeps the short bound
    assert not history_events(run, "mirror_final_wait")
    assert stopped["steps"] and f"ripresa mirror push {run}" in err and "stopped by signal" in out


# ---------------------------------------------------------------------------- status == push


def _json_out(capsys, argv: list[str]) -> dict:
    capsys.readouterr()
    assert cli_main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_status_lists_exactly_what_push_then_uploads(tmp_path, capsys):
    """One plan for both: a half upload, a generation whose marker is in the store but not one of its files, a
    damaged local generation and ones the mirror's retention does not keep (the old status listed 2, 4, 8, 12
    and push uploaded 12)."""
    run, remote = tmp_path / "run", tmp_path / "other-disk" / "mirror"
    train(run, 12, 2, keep=10)  # local generations 2, 4, 6, 8, 10, 12
    assert sorted(local_generations(run).values()) == [2, 4, 6, 8, 10, 12]
    first = _json_out(capsys, ["mirror", "push", str(run), "--mirror", str(remote), "--keep", "last=8", "--json"])
    assert first["uploaded"] == [2, 4, 6, 8, 10, 12]
    name = "step_{:06d}.safetensors".format
    (remote / (name(12) + ".sha256")).unlink()  # 12: a half upload (objects, no marker)
    (remote / name(10)).unlink()  # 10: its marker is in the store, its weights are not
    for suffix in ("", ".json", ".sha256"):  # 8: not in the store, and damaged locally (one byte, same size)
        (remote / (name(8) + suffix)).unlink()
    for step in (2, 4):
        for suffix in ("", ".json", ".sha256"):
            (remote / (name(step) + suffix)).unlink()
    data = bytearray((run / name(8)).read_bytes())
    data[-1] ^= 0x01
    (run / name(8)).write_bytes(bytes(data))

    status = _json_out(capsys, ["mirror", "status", str(run), "--mirror", str(remote), "--keep", "last=4", "--json"])
    pushed = _json_out(capsys, ["mirror", "push", str(run), "--mirror", str(remote), "--keep", "last=4", "--json"])
    print(status, pushed)
    assert status["pending"] == pushed["uploaded"] == [4, 10, 12]
    assert status["partial"] == [10, 12] and status["not_needed"] == [2]
    assert [(d["step"], d["file"]) for d in status["damaged"]] == [(8, name(8))]
    assert "does not match its commit marker" in status["damaged"][0]["reason"]
    assert status["pending_bytes"] == sum((run / (name(s) + x)).stat().st_size
                                          for s in (4, 10, 12) for x in ("", ".json", ".sha256"))
    for step in (4, 10, 12):  # whole, marker last, byte for byte the local files
        for suffix in ("", ".json", ".sha256"):
            assert (remote / (name(step) + suffix)).read_bytes() == (run / (name(step) + suffix)).read_bytes()
    assert not (remote / (name(8) + ".sha256")).exists()
    after = _json_out(capsys, ["mirror", "status", str(run), "--mirror", str(remote), "--keep", "last=4", "--json"])
    assert after["pending"] == [] and after["partial"] == [] and [d["step"] for d in after["damaged"]] == [8]
    again = _json_out(capsys, ["mirror", "push", str(run), "--mirror", str(remote), "--keep", "last=4", "--json"])
    assert again["uploaded"] == []
    # the text output names the same plan
    capsys.readouterr()
    data[-1] ^= 0x01  # 8 mended: the newest four of 2..12 are 6, 8, 10, 12, so the plan uploads it
    (run / name(8)).write_bytes(bytes(data))
    assert cli_main(["mirror", "status", str(run), "--mirror", str(remote), "--keep", "last=4"]) == 0
    text = capsys.readouterr().out
    assert "missing (push uploads them): [8]" in text, text


# ---------------------------------------------------------------------------- a framework callback


@pytest.mark.slow  # Lightning's import alone is seconds of CPU
def test_lightning_callback_reports_safe_then_pending(tmp_path, s3, proxy):
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from ripresa.integrations.lightning import ExactResume
    from ripresa.store.store import CheckpointWarning

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))

    def fit(run: Path, steps: int, *callbacks: pl.Callback) -> None:
        trainer = pl.Trainer(max_steps=steps, callbacks=list(callbacks), logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))

    safe = ExactResume(tmp_path / "a", every=2, handle_signals=False, mirror=fast(s3.url), final_upload_timeout=30)
    fit(tmp_path / "a", 4, safe)
    assert safe.close_result is not None and safe.close_result.safe_off_machine and safe.upload_pending == []
    assert 4 in s3.committed()

    class Down(pl.Callback):  # the store goes away after the first step (a blank run folder needs it at the start)
        def on_train_batch_end(self, trainer, *_):
            if trainer.global_step == 1:
                proxy.mode = "down"
                proxy.drop_all()

    pending = ExactResume(tmp_path / "b", every=2, handle_signals=False, mirror=fast(s3.url + "-b"),
                          final_upload_timeout=1)
    with pytest.warns(CheckpointWarning, match=r"ripresa mirror push .*b --mirror"):
        fit(tmp_path / "b", 4, pending, Down())
    assert pending.upload_pending == [2, 4] and pending.close_result.exit_code == 3
    assert pending.close_result.seconds >= 1.0


# ---------------------------------------------------------------------------- slow: the deadline, a terminal


@pytest.mark.slow
def test_a_normal_end_never_waits_past_the_deadline(tmp_path, s3, proxy, capsys):
    """``final_upload_timeout=600`` but the run's deadline is ~20 s away: the close leaves at the deadline."""
    from datetime import UTC, datetime

    run = tmp_path / "run"
    deadline = time.time() + 20.0  # the deadline's plan stops ~10 s before it: 4 quick steps end normally first
    ckpt, result = loop(run, 4, 2, fast(s3.url), after_step=down_before(proxy, s3, 4, 2), handle_signals=False,
                        final_upload_timeout=600, deadline=datetime.fromtimestamp(deadline, UTC))
    ended = time.time()
    print(capsys.readouterr().err, result)
    assert ckpt.deadline.stopped_at_step is None  # a normal end, not a deadline stop
    assert result.pending == (4,) and result.exit_code == 3 and "within the deadline" in result.reason, result
    assert deadline - 1.0 <= ended <= deadline + 2.0  # it waited for the store until the deadline, not 600 s
    assert history_events(run, "mirror_final_wait")[-1]["bound"] == "the deadline"


@pytest.mark.slow
def test_on_a_terminal_the_wait_shows_the_store_what_is_pending_and_the_time_left(tmp_path, s3, proxy, one_thread):

    run = tmp_path / "run"
    assert cli_main(["train", "--run", str(run), "--steps", "2", "--every", "2", "--mirror", s3.url, *GPT]) == 0
    proxy.mode = "down"
    proxy.drop_all()
    tty = PtyStderr()  # stderr is a terminal
    proc = subprocess.Popen([sys.executable, "-m", "ripresa", "train", "--run", str(run), "--steps", "4", "--every",
                             "2", "--mirror", s3.url, "--final-upload-timeout", "4", *GPT],
                            stdout=subprocess.PIPE, stderr=tty.slave, cwd=REPO, env=dict(os.environ, COLUMNS="200"))
    tty.start()
    try:
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        tty.close()
    err = tty.text()
    print(err[-3000:])
    assert rc == 3, err[-3000:]
    assert re.search(r"\d+/\d+ uploaded", err), err[-3000:]  # generations uploaded of those pending (ripresa.console)
    assert f"waiting for the store {s3.url}" in err and re.search(r"step\(s\) [\d, ]*4 pending \([\d.]+ [kMG]?B\), "
                                                                  r"0:0\d left", err), err[-3000:]
    assert "Ctrl-C to leave them pending" in err and f"ripresa mirror push {run} --mirror {s3.url}" in err


@pytest.mark.slow  # transformers' import alone is seconds of CPU
def test_hf_trainer_callback_reports_safe_then_pending(tmp_path, s3, proxy, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from ripresa.integrations.transformers import ExactResume
    from ripresa.store.store import CheckpointWarning

    class Rows(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.rows = torch.randint(0, 32, (32, 8), generator=torch.Generator().manual_seed(1))

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}

    def fit(run: Path, cb: ExactResume, *more: TrainerCallback) -> None:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))
        args = TrainingArguments(output_dir=str(tmp_path / "scratch"), max_steps=4, per_device_train_batch_size=8,
                                 save_strategy="no", use_cpu=True, report_to="none", disable_tqdm=True,
                                 logging_steps=1, dataloader_num_workers=0)
        Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[cb, *more]).train()

    safe = ExactResume(tmp_path / "a", every=2, mirror=fast(s3.url), final_upload_timeout=30)
    fit(tmp_path / "a", safe)
    assert safe.close_result is not None and safe.close_result.safe_off_machine and safe.upload_pending == []
    assert 4 in s3.committed()

    class GoDown(TrainerCallback):  # the store goes away after the first step (a blank folder needs it at the start)
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                proxy.mode = "down"
                proxy.drop_all()

    pending = ExactResume(tmp_path / "b", every=2, mirror=fast(s3.url + "-b"), final_upload_timeout=1)
    with pytest.warns(CheckpointWarning, match=r"ripresa mirror push .*b --mirror"):
        fit(tmp_path / "b", pending, GoDown())
    assert pending.upload_pending == [2, 4] and pending.close_result.exit_code == 3
    assert pending.close_result.seconds >= 1.0
