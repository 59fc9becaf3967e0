"""benchmarks/bench_frameworks.py: the harness that measures each framework's own resume against ripresa's."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest
import torch
from conftest import REPO, run
from safetensors.torch import save_file

FAKE = REPO / "tests" / "support" / "fake_framework_train.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_frameworks", REPO / "benchmarks" / "bench_frameworks.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_frameworks", mod)  # dataclasses look their module up
    spec.loader.exec_module(sys.modules["bench_frameworks"])
    return sys.modules["bench_frameworks"]


def test_tensor_and_log_comparisons_are_bitwise(tmp_path):
    bench = _bench()
    a = {"w": torch.tensor([1.0, 2.0, -0.0]), "b": torch.tensor([0.5]), "n": torch.tensor([3])}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file({k: v.clone() for k, v in a.items()}, str(tmp_path / "same.safetensors"))
    gap = bench.compare_tensors(tmp_path / "a.safetensors", tmp_path / "same.safetensors")
    assert (gap.differing, gap.total, gap.max_abs_gap) == (0, 3, 0.0)
    # +0.0 vs -0.0 equal as numbers, not as bits; 2 -> 2 + 1 ulp; an extra key
    b = {"w": torch.tensor([1.0, torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)).item(), 0.0]),
         "b": torch.tensor([0.5]), "n": torch.tensor([3]), "extra": torch.tensor([1.0])}
    save_file(b, str(tmp_path / "b.safetensors"))
    gap = bench.compare_tensors(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert gap.differing == 2 and gap.total == 4 and gap.missing == ["extra"]
    assert gap.max_abs_gap == pytest.approx(2.384185791015625e-07)
    # logs: the last record of a step wins (a resumed process logs it again); a torn line is skipped
    ref, other = tmp_path / "ref.jsonl", tmp_path / "other.jsonl"
    ref.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n')
    other.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 9.0}\n{"step": 2, "loss": 0.25}\n{"step": 3, "lo')
    assert bench.compare_logs(ref, other) == {"steps_logged": 2, "equal": True, "differences": 0, "first_difference": None,
                                              "not_compared": []}
    # wall-clock values (HF's train_runtime, ..._per_second) differ between any two runs: not compared, listed
    ref.write_text('{"step": 1, "loss": 0.5, "train_runtime": 12.5, "train_steps_per_second": 3.2}\n')
    other.write_text('{"step": 1, "loss": 0.5, "train_runtime": 50.1, "train_steps_per_second": 0.8}\n')
    cmp = bench.compare_logs(ref, other)
    assert cmp["equal"] and cmp["not_compared"] == ["train_runtime", "train_steps_per_second"]
    ref.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n')
    other.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.2500001}\n')
    cmp = bench.compare_logs(ref, other)
    assert not cmp["equal"] and cmp["first_difference"]["step"] == 2 and cmp["first_difference"]["key"] == "loss"
    assert not bench.compare_logs(ref, tmp_path / "missing.jsonl")["equal"]
    assert bench.lines_added(FAKE) == 2 and math.isinf(float(bench._gap(math.inf)))
    quoted = tmp_path / "quoted.py"
    quoted.write_text('"""Lines marked ``# ripresa: the one line``."""\n# ripresa: the one line\nx = 1  # ripresa: the one line\n')
    assert bench.lines_added(quoted) == 1
    # an accelerate loop has no callbacks: its added lines are marked `# ripresa`; imports are not counted
    quoted.write_text('"""Marked ``# ripresa``."""\nimport ripresa  # ripresa\nfrom x import y  # ripresa: the one line\n'
                      's = ripresa.TrainingState(m,  # ripresa\n    data=d)  # ripresa\nk = "# ripresa"\n'
                      'k.close()  # ripresa\nk.save()  # ripresas\n')
    assert bench.lines_added(quoted) == 3
    assert [bench.lines_added(REPO / "examples" / f / "train.py") for f in ("lightning", "hf_trainer", "accelerate")] \
        == [1, 1, 7]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # six fresh processes: minutes on a shared 2-core machine (a hang guard, not a speed test)
def test_the_harness_measures_a_fake_framework_end_to_end(tmp_path):
    """Six real processes (two SIGKILLed by themselves): the native resume drifts, ripresa's is bitwise."""
    out = tmp_path / "results"
    res = run([sys.executable, str(REPO / "benchmarks" / "bench_frameworks.py"), "--script", f"fake={FAKE}",
               "--max-steps", "14", "--every", "4", "--kill-after", "9", "--out", str(out), "--quiet"], timeout=1700)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((out / "bench_frameworks.json").read_text())
    (row,) = report["rows"]
    assert row["ripresa"]["tensors_differing"] == 0 and row["ripresa"]["max_abs_gap"] == 0.0
    assert row["ripresa"]["logged"]["equal"] and row["ripresa"]["logged"]["steps_logged"] == 14
    assert row["native"]["tensors_differing"] == row["native"]["tensors_total"] == 4 and row["native"]["max_abs_gap"] > 0
    assert not row["native"]["logged"]["equal"] and row["lines_added"] == 2
    md = (out / "bench_frameworks.md").read_text()
    assert "| fake | 4 / 4 |" in md and "| 0 / 4 | 0 | " in md and "after step 9" in md


@pytest.mark.slow
def test_a_script_that_does_not_die_at_the_kill_step_is_refused(tmp_path):
    script = tmp_path / "never_killed.py"
    script.write_text("import argparse, pathlib\nap = argparse.ArgumentParser()\n"
                      "[ap.add_argument(a) for a in ('--run', '--max-steps', '--every', '--mode', '--final', '--log', '--seed')]\n"
                      "a = ap.parse_args()\npathlib.Path(a.final).write_bytes(b'')\n")
    res = run([sys.executable, str(REPO / "benchmarks" / "bench_frameworks.py"), "--script", f"x={script}",
               "--max-steps", "4", "--every", "1", "--kill-after", "2", "--out", str(tmp_path / "r"), "--quiet"])
    assert res.returncode == 2 and "not by SIGKILL" in res.stderr
    assert not (tmp_path / "r").exists()


def test_keep_rows_merges_an_earlier_report_for_the_frameworks_not_run_now(tmp_path):
    bench = _bench()
    settings = {"max_steps": 40, "every": 10, "kill_after": 25, "seed": 0, "versions": "torch x"}
    earlier = tmp_path / "bench_frameworks.json"
    earlier.write_text(json.dumps({"date": "2026-01-01", "settings": settings, "rows": [
        {"framework": "hf_trainer", "v": "old"}, {"framework": "lightning", "v": "old"},
        {"framework": "accelerate", "v": "old"}]}))
    rows, missing = bench._kept_rows(earlier, [{"framework": "accelerate", "v": "new", "date": "2026-02-02"}],
                                     [], settings)
    assert [(r["framework"], r["v"], r["date"]) for r in rows] == [
        ("lightning", "old", "2026-01-01"), ("hf_trainer", "old", "2026-01-01"), ("accelerate", "new", "2026-02-02")]
    assert missing == []
    with pytest.raises(SystemExit, match="measured with"):
        bench._kept_rows(earlier, [], [], {**settings, "kill_after": 20})
    with pytest.raises(SystemExit, match="cannot read"):
        bench._kept_rows(tmp_path / "absent.json", [], [], settings)


@pytest.mark.slow
def test_a_run_past_the_timeout_is_reported_not_a_traceback(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text("import time\ntime.sleep(60)\n")
    res = run([sys.executable, str(REPO / "benchmarks" / "bench_frameworks.py"), "--script", f"x={script}",
               "--max-steps", "4", "--every", "1", "--kill-after", "2", "--timeout", "2", "--jobs", "1",
               "--out", str(tmp_path / "r"), "--quiet"])
    assert res.returncode == 2 and "ran past --timeout 2 s" in res.stderr and "Traceback" not in res.stderr
