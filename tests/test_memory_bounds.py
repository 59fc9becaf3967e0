"""Memory bounded by design (docs/FAULTS.md, "Memory"): hostile companions, JSON and histories.

Each hostile input gives a typed error or a bounded result; the subprocess cases measure the
peak RSS of the real command (``resource.getrusage(RUSAGE_CHILDREN)`` of a fresh interpreter
that runs only that command) and hold it under a bound.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from support.tiny import tiny_state

import ripresa
from ripresa.errors import IntegrityError
from ripresa.formats import companion as companion_fmt
from ripresa.io.fsio import MAX_JSON_COST, json_parse_cost, parse_json_bytes
from ripresa.store.general import general_paths, validate_general

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ helpers

def _general_run(folder: Path, steps: int = 2) -> None:
    state = tiny_state((4, 4), optimizer="sgd", lr=0.1)  # tests/support/tiny.py
    model = state.model
    with ripresa.Checkpointer(folder, state, every=1, asynchronous=False, handle_signals=False) as ck:
        for step in range(ck.resume() + 1, steps + 1):
            state.optimizer.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            state.optimizer.step()
            ck.step_done(step)


def _reseal_companion(folder: Path, step: int, doc: dict) -> Path:
    """Write a companion and recompute its marker line, as an attacker without the key can."""
    _, comp, marker = general_paths(folder, step)
    comp.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    sha = hashlib.sha256(comp.read_bytes()).hexdigest()
    lines = marker.read_text().splitlines(keepends=True)
    marker.write_text("".join(re.sub(r"^[0-9a-f]{64}", sha, ln) if ln.rstrip().endswith(comp.name) else ln
                              for ln in lines))
    return comp


def _list_ref(doc: dict) -> dict:
    """A list reference of the companion (Python's random state: 625 ints stored as an int64 tensor)."""
    stack = [doc["state"]]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("list") == "int64" and "__ref__" in node:
                return node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    raise AssertionError("no list reference in the companion")


def _peak_rss_mb(code: str, *, cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    """Run ``code`` in a fresh interpreter; its peak RSS (MB, from RUSAGE_CHILDREN of a parent that runs nothing else)."""
    probe = textwrap.dedent(f"""
        import resource, subprocess, sys
        p = subprocess.run([sys.executable, "-c", {code!r}], capture_output=True, text=True)
        sys.stdout.write(p.stdout); sys.stderr.write(p.stderr)
        print("RC", p.returncode)
        print("PEAK_KB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=cwd, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    peak = int(re.search(r"PEAK_KB (\d+)", out.stdout).group(1)) / 1024
    return peak, out


def _cli(*args: str) -> str:
    return f"import sys; from ripresa.cli import main; sys.exit(main({list(args)!r}))"


# ------------------------------------------------------------------------------------ 1. references

@pytest.mark.slow
def test_a_tensor_referenced_many_times_is_refused_and_a_resume_falls_back(tmp_path):
    """A companion naming one stored list 2000 times (the reference bomb, ~3 GB at 10**5 times) reads invalid,
    with a typed reason, and a resume takes the previous generation."""
    run = tmp_path / "run"
    _general_run(run, 2)
    _, comp, _ = general_paths(run, 2)
    doc = json.loads(comp.read_text())
    ref = _list_ref(doc)
    doc["state"]["extra"]["bomb"] = [dict(ref) for _ in range(2000)]
    _reseal_companion(run, 2, doc)
    gen = validate_general(run, 2, deep=True).generation
    assert not gen.valid
    assert "referenced more often than the schema allows" in gen.reason
    state = tiny_state((4, 4), seed=None, optimizer="sgd", lr=0.1)
    with pytest.warns(Warning), ripresa.Checkpointer(run, state, every=1, asynchronous=False,
                                                     handle_signals=False) as ck:
        assert ck.resume() == 1


def test_ref_budget_allows_each_alias_once_more_and_nothing_else():
    t = {"a": torch.zeros(2), "b": torch.zeros(2)}
    budget = companion_fmt.RefBudget(t, {"model/tied": "a"})
    budget.use("a", "x")
    budget.use("a", "x")  # the alias
    budget.use("b", "x")
    with pytest.raises(IntegrityError, match="referenced more often"):
        budget.use("a", "x")
    with pytest.raises(IntegrityError, match="referenced more often"):
        budget.use("b", "x")


def test_decode_tree_is_iterative_and_refuses_depth_with_a_typed_error():
    deep: object = 0
    for _ in range(companion_fmt.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(IntegrityError, match="nested too deeply"):
        companion_fmt.decode_tree(deep)
    ok: object = {"__tuple__": [1, {"__dict__": [[3, [2.5, None]]]}]}
    for _ in range(companion_fmt.MAX_DEPTH - 4):
        ok = {"k": ok}
    back = companion_fmt.decode_tree(ok)
    for _ in range(companion_fmt.MAX_DEPTH - 4):
        back = back["k"]
    assert back == (1, {3: [2.5, None]})


def test_an_error_about_a_huge_node_does_not_print_it_whole():
    huge = {"__tuple__": list(range(10**6)), "extra": 1}
    with pytest.raises(IntegrityError) as err:
        companion_fmt.decode_tree(huge)
    assert len(str(err.value)) < 2000


# --------------------------------------------------------------------------------- 2. JSON parse cost

@pytest.mark.parametrize("body", [b"{}", b"[]", b'{"a":1}', b"[[]]", b'""', b"0"])
def test_the_parse_cost_estimate_bounds_what_json_loads_allocates(body):
    import tracemalloc

    raw = b"[" + b",".join([body] * 20000) + b"]"
    tracemalloc.start()
    try:
        doc = json.loads(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del doc
    assert json_parse_cost(raw) >= peak


def test_a_document_of_tiny_containers_is_refused_before_it_is_parsed():
    raw = b'{"format":"ripresa.general","state":{"x":[' + b",".join([b"{}"] * (1 << 20)) + b"]}}"
    assert json_parse_cost(raw) > MAX_JSON_COST // 2
    with pytest.raises(IntegrityError, match="too much memory to parse"):
        parse_json_bytes(raw, "c.json", "companion", error=IntegrityError, max_cost=MAX_JSON_COST // 2)
    with pytest.raises(IntegrityError, match="too much memory to parse"):
        companion_fmt.loads_bounded(raw, max_cost=MAX_JSON_COST // 2)
    # a real companion's shape passes: floats and a few keys cost a few bytes per byte
    real = json.dumps({"data": [0.123456789 * i for i in range(100000)]}).encode()
    assert json_parse_cost(real) < 6 * len(real)
    assert companion_fmt.loads_bounded(real)["data"][2] == 0.123456789 * 2


@pytest.mark.slow
def test_a_32_mib_hostile_general_companion_is_refused_in_bounded_memory(tmp_path):
    """inspect --deep of a run whose companion is 15 MiB of empty containers (the general cap is 16 MiB),
    resealed: a typed refusal, peak RSS of the whole command under 400 MB (it was ~1 GB)."""
    run = tmp_path / "run"
    _general_run(run, 2)
    _, comp, _ = general_paths(run, 2)
    doc = json.loads(comp.read_text())
    doc["state"]["extra"]["x"] = "@@"
    text = json.dumps(doc, separators=(",", ":")).replace('"@@"', "[" + ",".join(["{}"] * (5 << 20)) + "]")
    comp.write_text(text)
    sha = hashlib.sha256(comp.read_bytes()).hexdigest()
    marker = general_paths(run, 2)[2]
    marker.write_text("".join(re.sub(r"^[0-9a-f]{64}", sha, ln) if ln.rstrip().endswith(comp.name) else ln
                              for ln in marker.read_text().splitlines(keepends=True)))
    peak, out = _peak_rss_mb(_cli("inspect", "--json", str(run / comp.name.removesuffix(".json"))), cwd=tmp_path)
    assert "Traceback" not in out.stdout + out.stderr
    assert "too much memory to parse" in out.stdout + out.stderr
    assert peak < 400, (peak, out.stdout[-2000:], out.stderr[-2000:])


@pytest.mark.slow
def test_a_reference_bomb_is_refused_in_bounded_memory(tmp_path):
    """20 000 references to one 625-int list (~12.5 M Python ints if expanded, ~1 GB): inspect refuses it
    with the reason, peak RSS under 400 MB."""
    run = tmp_path / "run"
    _general_run(run, 2)
    _, comp, _ = general_paths(run, 2)
    doc = json.loads(comp.read_text())
    doc["state"]["extra"]["bomb"] = [dict(_list_ref(doc)) for _ in range(20000)]
    _reseal_companion(run, 2, doc)
    peak, out = _peak_rss_mb(_cli("inspect", "--json", str(general_paths(run, 2)[0])), cwd=tmp_path)
    assert "Traceback" not in out.stdout + out.stderr
    assert "referenced more often" in out.stdout + out.stderr
    assert peak < 400, (peak, out.stdout[-2000:], out.stderr[-2000:])


# ------------------------------------------------------------------------------------------ 4. history

def _hostile_history(path: Path, mib: int) -> None:
    """A quarter of step lines with a 2 KB nested payload each, half of short step lines (~25 bytes, distinct
    steps: about a million), a quarter of event lines with payloads and blank lines."""
    pad = json.dumps({"k": [[i] for i in range(300)]}, separators=(",", ":"))
    with open(path, "w") as f:
        step, size = 1, 0
        while size < mib << 18:
            line = f'{{"step":{step},"loss":{1.0 + step % 7},"arm":"a{step % 3}","junk":{pad}}}\n'
            f.write(line)
            size += len(line)
            step += 1
        while size < 3 * (mib << 18):
            line = f'{{"step":{step},"loss":{1.0 + step % 7}}}\n'
            f.write(line)
            size += len(line)
            step += 1
        while size < mib << 20:
            line = (f'{{"event":"resume","from_step":{step % 50},"junk":{pad}}}\n'
                    f'{{"event":"checkpoint","step":{step},"junk":{pad}}}\n\n')
            f.write(line)
            size += len(line)


def test_history_records_and_skipped_lines_are_bounded(tmp_path):
    from ripresa.store.history import MAX_SKIPPED_LISTED, read_history, reduce_record

    h = tmp_path / ".loss.jsonl"
    big = json.dumps({"x": list(range(5000))})
    lines = ['{"step":1,"loss":2.5,"arm":"a","signals":["SIGTERM"],"junk":' + big + ',"long":"' + "z" * 600 + '"}']
    lines += ["not json"] * (MAX_SKIPPED_LISTED + 50)
    lines += ['{"event":"pivot","step":1,"new_policy":{"arms":["a","b"],"w":[0.5,0.5]},"blob":' + big + "}"]
    h.write_text("\n".join(lines) + "\n")
    view = read_history(h)
    assert view.steps[1] == {"step": 1, "loss": 2.5, "arm": "a", "signals": ["SIGTERM"]}
    assert view.events == [{"event": "pivot", "step": 1, "new_policy": {"arms": ["a", "b"], "w": [0.5, 0.5]}}]
    assert view.skipped == MAX_SKIPPED_LISTED + 50 and len(view.skipped_lines) == MAX_SKIPPED_LISTED
    assert reduce_record({f"k{i}": i for i in range(1000)}) == {f"k{i}": i for i in range(256)}


def test_plot_keeps_the_last_line_per_step_in_compact_arrays(tmp_path):
    from ripresa.engine import run_history

    run = tmp_path / "run"
    run.mkdir()
    rows = [(s, 10.0 - s * 0.001) for s in range(1, 3001)] + [(s, 0.5) for s in range(100, 200)]  # a resume re-logs
    rows += [(s, 1.0) for s in range(3001, 3101)]
    with open(run / ".loss.jsonl", "w") as f:
        for s, loss in rows:
            f.write(json.dumps({"step": s, "loss": loss, "arm": "x" if s % 2 else "y"}) + "\n")
        f.write('{"event":"checkpoint","step":5}\n')
    r = run_history.load_run(run)
    assert list(r.steps) == list(range(1, 3101))
    assert r.losses[150 - 1] == 0.5 and r.losses[99 - 1] == 10.0 - 99 * 0.001 and r.losses[-1] == 1.0
    assert r.arms[0] == "x" and r.arms[1] == "y" and list(r.checkpoint_steps) == [5]
    c = run_history._Canonical()  # compaction keeps the last row of each step, sorted
    for s, loss in [(3, 1.0), (1, 2.0), (3, 3.0), (2, 4.0), (1, 5.0)]:
        c.add(s, loss, -1)
    c.compact()
    assert list(c.steps) == [1, 2, 3] and list(c.losses) == [5.0, 4.0, 3.0]


@pytest.mark.slow
def test_a_long_run_is_drawn_downsampled_with_numbers_from_every_step(tmp_path):
    from ripresa.engine import plots

    run = tmp_path / "run"
    run.mkdir()
    n = plots.MAX_DRAWN_POINTS * 2 + 7
    with open(run / ".loss.jsonl", "w") as f:
        f.writelines(f'{{"step":{s},"loss":{1.0 + (s % 10) / 10},"arm":"{"ab"[s % 2]}"}}\n' for s in range(1, n + 1))
    plots.plot_run(run, tmp_path / "p.png")
    info = plots.last_plot_info
    assert info["steps"] == n and info["last_step"] == n and info["last_loss"] == 1.0 + (n % 10) / 10
    assert info["drawn_points"] <= plots.MAX_DRAWN_POINTS + 1 and info["arms"] == ["a", "b"]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["plot", "compare", "fork"])
def test_a_64_mib_history_is_reduced_in_bounded_memory(tmp_path, command):
    """plot, compare and fork of a run whose history is 64 MiB (steps and events with nested payloads):
    peak RSS under 400 MB (it was 1.7-1.9 GB)."""
    run = tmp_path / "run"
    _general_run(run, 2) if command == "fork" else run.mkdir()
    _hostile_history(run / ".loss.jsonl", 64)
    if command == "plot":
        code = _cli("plot", str(run), "--png", str(tmp_path / "p.png"))
    elif command == "compare":
        code = _cli("compare", str(run), str(run), "--json")
    else:
        code = "from ripresa.engine.fork import _copy_history_up_to, _open_history; " \
               "from ripresa.store.history import History; from pathlib import Path; " \
               f"h = History(Path({str(tmp_path / 'out.jsonl')!r})); " \
               f"print('COPIED', _copy_history_up_to(Path({str(run)!r}), _open_history(Path({str(run)!r})), 10**9, h))"
    peak, out = _peak_rss_mb(code, cwd=tmp_path)
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    assert "RC 0" in out.stdout, (out.stdout[-2000:], out.stderr[-2000:])
    assert peak < 400, peak


# ------------------------------------------------------------------------------------------ 3. convert

def _plain_bin(path: Path, n_params: int) -> Path:
    path.write_bytes((4).to_bytes(8, "little") + bytes(12 * n_params))
    return path


def test_convert_compares_the_described_size_before_building(tmp_path):
    """A 12 KB plain .bin with a config describing a 120M-parameter GPT: refused from the config's arithmetic,
    before the model is built (it was built first: ~0.5 GB, up to 8 GiB for a larger config)."""
    from ripresa.engine.gpt.factory import GPT_FACTORY
    from ripresa.tools.convert import load

    src = _plain_bin(tmp_path / "plain.bin", 1000)
    with pytest.raises(IntegrityError, match="describes another number of parameters") as err:
        load(src, config="andrea-120m", model_factory=GPT_FACTORY)
    assert "nothing was built" in str(err.value.hint)


@pytest.mark.slow
def test_convert_of_a_mismatched_config_stays_small(tmp_path):
    src = _plain_bin(tmp_path / "plain.bin", 1000)
    peak, out = _peak_rss_mb(_cli("convert", str(src), str(tmp_path / "out.bin"), "--config", "andrea-120m"),
                             cwd=tmp_path)
    assert "Traceback" not in out.stdout + out.stderr
    assert "describes another number of parameters" in out.stderr
    assert peak < 400, peak
