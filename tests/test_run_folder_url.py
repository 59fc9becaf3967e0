"""A URL is never a run folder: refused with the mirror= hint (or, for file://, the local folder it names)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import ripresa_cli

import ripresa
from ripresa.errors import BadInput
from ripresa.session.checkpointer import local_run_dir


@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://b/runs/x", "https://host/run", Path("s3://bucket/run"),
                                 "S3://Bucket/run", "file://otherhost/x"])
def test_a_url_run_folder_is_refused_and_creates_nothing(tmp_path, monkeypatch, url, tiny):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInput) as err:
        ripresa.Checkpointer(url, tiny, every=0, handle_signals=False)
    assert list(tmp_path.iterdir()) == []  # no ./s3:/bucket/run
    if "otherhost" not in str(url):
        text = str(err.value)
        assert "mirror=" in text and "--mirror" in text and "://" in text, text


def test_the_hint_gives_the_url_back_even_from_a_path(tmp_path):
    with pytest.raises(BadInput) as err:
        local_run_dir(Path("s3://bucket/run"))  # Path() made it s3:/bucket/run
    assert "mirror='s3://bucket/run'" in str(err.value)


def test_file_urls_and_look_alikes_are_local_folders(tmp_path, monkeypatch, tiny):
    monkeypatch.chdir(tmp_path)
    assert local_run_dir(f"file://{tmp_path}/run") == tmp_path / "run"
    assert local_run_dir(f"file://localhost{tmp_path}/run") == tmp_path / "run"
    assert local_run_dir(Path(f"file://{tmp_path}/run")) == tmp_path / "run"
    assert local_run_dir("./s3:/bucket") == Path("s3:/bucket")  # explicitly relative: a folder named s3:
    assert local_run_dir("runs/x") == Path("runs/x") and local_run_dir("C:/x") == Path("C:/x")
    ckpt = ripresa.Checkpointer(f"file://{tmp_path}/run", tiny, every=0, handle_signals=False, asynchronous=False)
    assert ckpt.run_dir == tmp_path / "run"
    assert ckpt.resume() == 0
    ckpt.step_done(1)
    ckpt.close()
    assert list((tmp_path / "run").glob("step_000001*")) and not os.path.lexists(tmp_path / "file:")


@pytest.mark.slow
def test_ripresa_train_refuses_a_url_run(tmp_path):
    res = ripresa_cli("train", "--run", "s3://bucket/run", "--steps", "1", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--mirror s3://bucket/run" in res.stderr and "Traceback" not in res.stderr
    assert list(tmp_path.iterdir()) == []
