"""Retention policies: table-driven cases and properties, all without a disk."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ripresa.errors import BadInput, RipresaError
from ripresa.store.retention import (
    DEFAULT_RETENTION,
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepSteps,
    RetentionPolicy,
    parse_retention,
    plan_deletions,
)

STEPS = [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1100, 1200]

# ---- keep(): table-driven ----------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "steps", "kept"),
    [
        (KeepLast(3), STEPS, {1000, 1100, 1200}),
        (KeepLast(1), STEPS, {1200}),
        (KeepLast(50), STEPS, set(STEPS)),
        (KeepLast(2), [], set()),
        (KeepLast(2), [7, 3, 9, 1], {7, 9}),  # order of the input does not matter
        (KeepLast(2), [5, 5, 5, 4], {4, 5}),  # duplicates count once
        (KeepEvery(500), STEPS, {500, 1000}),
        (KeepEvery(1), STEPS, set(STEPS)),
        (KeepEvery(7), [0, 7, 13, 14], {0, 7, 14}),  # step 0 is divisible by anything
        (KeepEvery(10_000), STEPS, set()),
        (KeepSteps(frozenset({500, 1200})), STEPS, {500, 1200}),
        (KeepSteps(frozenset({550})), STEPS, set()),  # a named step without a generation
        (KeepLast(2) | KeepEvery(500), STEPS, {500, 1000, 1100, 1200}),
        (KeepLast(1) | KeepSteps({300}) | KeepEvery(400), STEPS, {300, 400, 800, 1200}),
    ],
)
def test_keep_table(policy: RetentionPolicy, steps: list[int], kept: set[int]) -> None:
    assert policy.keep(steps) == kept


@pytest.mark.parametrize(
    ("policy", "steps", "newest", "protected", "deleted"),
    [
        # keep last 3 of 12: delete the 9 oldest
        (KeepLast(3), STEPS, 1200, (), STEPS[:9]),
        # a protected step (being written / read by a fork) survives
        (KeepLast(3), STEPS, 1200, (100, 700), [200, 300, 400, 500, 600, 800, 900]),
        # a protected step that has no valid generation changes nothing
        (KeepLast(3), STEPS, 1200, (150,), STEPS[:9]),
        # a policy that drops the newest valid step cannot delete it
        (KeepSteps({100}), [100, 200, 300], 300, (), [200]),
        (KeepEvery(1000), [999, 1000, 1001], 1001, (), [999]),
        # nothing to delete
        (KeepLast(3), [100, 200], 200, (), []),
        (KeepLast(3), [], None, (), []),
        # no newest_valid given: the largest step is still never deleted
        (KeepSteps({100}), [100, 200, 300], None, (), [200]),
        # newest_valid names a step below the largest: both are kept (safe side)
        (KeepSteps({100}), [100, 200, 300], 200, (), []),
        # milestones plus last 2
        (KeepLast(2) | KeepEvery(500), STEPS, 1200, (), [100, 200, 300, 400, 600, 700, 800, 900]),
    ],
)
def test_plan_deletions_table(
    policy: RetentionPolicy,
    steps: list[int],
    newest: int | None,
    protected: tuple[int, ...],
    deleted: list[int],
) -> None:
    assert plan_deletions(steps, policy, newest_valid=newest, protected=protected) == deleted


def test_plan_deletions_is_sorted_whatever_the_input_order() -> None:
    shuffled = STEPS[:]
    random.Random(0).shuffle(shuffled)
    assert plan_deletions(shuffled, KeepLast(2), newest_valid=1200) == STEPS[:10]


def test_default_is_keep_last_three() -> None:
    assert DEFAULT_RETENTION == KeepLast(3)
    assert DEFAULT_RETENTION.spec == "last=3"


def test_numpy_integers_are_steps() -> None:
    steps = np.array([10, 20, 30], dtype=np.int64)
    assert KeepLast(np.int32(2)).keep(list(steps)) == {20, 30}
    assert plan_deletions(steps, KeepLast(1), newest_valid=np.int64(30)) == [10, 20]


# ---- construction is validated -----------------------------------------------


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: KeepLast(0), ValueError),
        (lambda: KeepLast(-1), ValueError),
        (lambda: KeepLast(2.5), TypeError),
        (lambda: KeepLast("3"), TypeError),
        (lambda: KeepLast(True), TypeError),
        (lambda: KeepEvery(0), ValueError),
        (lambda: KeepEvery(None), TypeError),
        (lambda: KeepSteps(frozenset()), ValueError),
        (lambda: KeepSteps({-5}), ValueError),
        (lambda: KeepSteps({1.5}), TypeError),
        (lambda: KeepSteps("500"), TypeError),
        (lambda: KeepSteps(500), TypeError),
        (lambda: KeepAny(()), ValueError),
        (lambda: KeepAny((KeepLast(1), "last=3")), TypeError),
        (lambda: KeepAny(KeepLast(1)), TypeError),
    ],
)
def test_bad_construction_is_a_programming_error(make, error) -> None:
    """Misuse of the Python API raises TypeError/ValueError, never a ripresa error (docs/FAULTS.md)."""
    with pytest.raises(error) as info:
        make()
    assert not isinstance(info.value, RipresaError)
    assert type(info.value) is error and str(info.value)


def test_bad_count_message_names_the_field_and_the_hint() -> None:
    with pytest.raises(ValueError, match=r"KeepLast\.n must be >= 1, got -1.*KeepLast\(1\)"):
        KeepLast(-1)
    with pytest.raises(TypeError, match=r"KeepEvery\.k must be an int >= 1, not a bool"):
        KeepEvery(True)


def test_policies_are_frozen_and_normalised() -> None:
    p = KeepSteps([1200, 500, 500])
    assert p.steps == frozenset({500, 1200}) and isinstance(p.steps, frozenset)
    with pytest.raises(AttributeError):
        p.steps = frozenset({1})  # type: ignore[misc]
    assert KeepAny((KeepLast(1) | KeepEvery(2), KeepSteps({3}))).policies == (
        KeepLast(1),
        KeepEvery(2),
        KeepSteps({3}),
    )


@pytest.mark.parametrize("bad_steps", [[1, -1], [1, 2.0], [True], ["3"]])
def test_bad_steps_are_refused(bad_steps: list[object]) -> None:
    with pytest.raises((TypeError, ValueError)):
        KeepLast(2).keep(bad_steps)  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError)):
        plan_deletions(bad_steps, KeepLast(2), newest_valid=None)  # type: ignore[arg-type]


def test_bad_newest_or_protected_is_refused() -> None:
    with pytest.raises(ValueError):
        plan_deletions([1, 2], KeepLast(1), newest_valid=-2)
    with pytest.raises(TypeError):
        plan_deletions([1, 2], KeepLast(1), newest_valid=2, protected=["x"])  # type: ignore[list-item]


# ---- the text form -----------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "policy"),
    [
        ("last=3", KeepLast(3)),
        ("every=1000", KeepEvery(1000)),
        ("steps=500", KeepSteps({500})),
        ("steps=0+500+1200", KeepSteps({0, 500, 1200})),
        ("last=3,every=1000", KeepAny((KeepLast(3), KeepEvery(1000)))),
        (
            "last=3,every=1000,steps=500+1200",
            KeepAny((KeepLast(3), KeepEvery(1000), KeepSteps({500, 1200}))),
        ),
        (" LAST = 2 , steps = 500 + 1200 ", KeepAny((KeepLast(2), KeepSteps({500, 1200})))),
        ("every=2,every=3", KeepAny((KeepEvery(2), KeepEvery(3)))),  # repeated key: union
    ],
)
def test_parse_retention(spec: str, policy: RetentionPolicy) -> None:
    assert parse_retention(spec) == policy


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "   ",
        "last",
        "last=",
        "last=0",
        "last=-1",
        "last=3.5",
        "last=three",
        "last=3,",
        ",last=3",
        "last=3;every=10",
        "every=0",
        "steps=",
        "steps=500++1200",
        "steps=-5",
        "steps=5,6",
        "keep=3",
        "last=3=4",
        "last=١٢",  # non-ASCII digits are not accepted silently
    ],
)
def test_parse_retention_refuses_bad_specs(spec: str) -> None:
    with pytest.raises(BadInput) as info:
        parse_retention(spec, source="config.json")
    err = info.value
    assert err.file == "config.json"
    assert "last=N" in str(err.expected)
    assert repr(spec) in str(err.found)
    assert err.hint and "last=3" in err.hint


def test_parse_retention_refuses_non_text() -> None:
    with pytest.raises(BadInput):
        parse_retention(3)  # type: ignore[arg-type]


def test_spec_strings() -> None:
    policy = KeepLast(3) | KeepEvery(1000) | KeepSteps({1200, 500})
    assert policy.spec == "last=3,every=1000,steps=500+1200"
    assert str(policy) == policy.spec
    assert parse_retention(policy.spec) == policy


# ---- properties --------------------------------------------------------------

step_lists = st.lists(st.integers(min_value=0, max_value=5000), max_size=40)


def leaf_policies() -> st.SearchStrategy[RetentionPolicy]:
    return st.one_of(
        st.builds(KeepLast, st.integers(min_value=1, max_value=12)),
        st.builds(KeepEvery, st.integers(min_value=1, max_value=1500)),
        st.builds(
            KeepSteps,
            st.frozensets(st.integers(min_value=0, max_value=5000), min_size=1, max_size=6),
        ),
    )


policies = st.one_of(
    leaf_policies(),
    st.lists(leaf_policies(), min_size=1, max_size=4).map(lambda ps: KeepAny(tuple(ps))),
)


@st.composite
def deletion_cases(draw):
    steps = draw(step_lists)
    policy = draw(policies)
    protected = draw(st.lists(st.integers(min_value=0, max_value=5000), max_size=5))
    if steps and draw(st.booleans()):
        protected += draw(st.lists(st.sampled_from(steps), max_size=3))
    newest = max(steps) if steps else None
    return steps, policy, newest, protected


@settings(max_examples=100, deadline=None)
@given(deletion_cases())
def test_newest_valid_and_protected_never_deleted(case) -> None:
    steps, policy, newest, protected = case
    deleted = plan_deletions(steps, policy, newest_valid=newest, protected=protected)
    if newest is not None:
        assert newest not in deleted
    assert not set(deleted) & set(protected)
    assert set(deleted) <= set(steps)
    assert deleted == sorted(set(deleted))
    # after deleting, something valid always remains to resume from
    assert not steps or set(steps) - set(deleted)


@settings(max_examples=100, deadline=None)
@given(deletion_cases())
def test_deletions_and_kept_are_disjoint_and_cover(case) -> None:
    steps, policy, newest, protected = case
    deleted = set(plan_deletions(steps, policy, newest_valid=newest, protected=protected))
    kept = policy.keep(steps)
    assert not deleted & kept
    # every step the policy drops is deleted, unless it is newest or protected
    dropped = set(steps) - kept - set(protected) - ({newest} if newest is not None else set())
    assert deleted == dropped


@settings(max_examples=100, deadline=None)
@given(deletion_cases())
def test_applying_twice_deletes_nothing_more(case) -> None:
    steps, policy, newest, protected = case
    deleted = plan_deletions(steps, policy, newest_valid=newest, protected=protected)
    remaining = sorted(set(steps) - set(deleted))
    assert plan_deletions(remaining, policy, newest_valid=newest, protected=protected) == []


@settings(max_examples=60, deadline=None)
@given(step_lists, st.lists(leaf_policies(), min_size=1, max_size=4))
def test_union_is_exactly_the_union_of_its_parts(steps, parts) -> None:
    union = KeepAny(tuple(parts)).keep(steps)
    each = [p.keep(steps) for p in parts]
    for kept in each:
        assert union >= kept
    assert union == set().union(*each)


@settings(max_examples=60, deadline=None)
@given(step_lists, policies, st.randoms(use_true_random=False))
def test_keep_is_a_subset_and_ignores_order(steps, policy, rnd) -> None:
    kept = policy.keep(steps)
    assert kept <= set(steps)
    shuffled = steps[:]
    rnd.shuffle(shuffled)
    assert policy.keep(shuffled) == kept


@settings(max_examples=60, deadline=None)
@given(step_lists, st.integers(min_value=1, max_value=12))
def test_keep_last_keeps_exactly_the_n_newest(steps, n) -> None:
    kept = KeepLast(n).keep(steps)
    distinct = sorted(set(steps))
    assert len(kept) == min(n, len(distinct))
    assert all(k >= s for k in kept for s in set(distinct) - kept)


@settings(max_examples=60, deadline=None)
@given(policies, step_lists)
def test_spec_round_trips(policy, steps) -> None:
    again = parse_retention(policy.spec)
    assert again == policy or (isinstance(policy, KeepAny) and len(policy.policies) == 1)
    assert again.keep(steps) == policy.keep(steps)


# ---- retention across kinds (docs/FORMAT.md, "Retention across kinds") --------------------------------------------


def test_after_a_format_change_keep_last_counts_bin_and_general_generations_as_one_sequence(tmp_path):
    """Three .bin generations, then the general format: keep_last=2 keeps the 2 newest whatever their kind, the
    old .bin ones are deleted as general ones commit; a .dcp folder in the run folder is never touched."""
    import os
    import warnings

    import torch
    from support.tiny import tiny_state

    import ripresa
    from ripresa.formats import dcp as dcp_fmt
    from ripresa.store import dcp as store_dcp
    from ripresa.store.retention import KeepLast

    state = tiny_state()
    model = state.model

    def steps_of(suffix: str) -> list[int]:
        return sorted(int(n[5:11]) for n in os.listdir(tmp_path) if n.endswith(suffix))

    def run(fmt: str, upto: int, seen: list[tuple[list[int], list[int]]]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the ignored .dcp, the resumed .bin: said, and tested elsewhere
            with ripresa.Checkpointer(tmp_path, state, every=1, asynchronous=False, handle_signals=False,
                                      retention=KeepLast(2), format=fmt) as ck:
                for step in range(ck.resume() + 1, upto + 1):
                    state.optimizer.zero_grad()
                    model(torch.randn(2, 4)).sum().backward()
                    state.optimizer.step()
                    ck.step_done(step)
                    seen.append((steps_of(".bin"), steps_of(".safetensors")))

    seen: list[tuple[list[int], list[int]]] = []
    run("andrea", 3, seen)
    assert seen[-1] == ([2, 3], [])
    # an older .dcp generation beside them (a single process resumes a .dcp only when it is the newest)
    part = dcp_fmt.partial_path(tmp_path, 1)
    dcp_fmt.save_shards(torch.nn.Linear(4, 3), None, part, no_dist=True)
    store_dcp.commit_dcp(tmp_path, 1, part, world_size=1, n_params=15, state={"progress": {"step": 1}})
    run("auto", 6, seen)
    assert seen[3:] == [([3], [4]), ([], [4, 5]), ([], [5, 6])]
    assert steps_of(".dcp") == [1] and dcp_fmt.check_dcp(tmp_path, 1).valid
    # and back: a .bin session prunes the general generations with its own
    run("andrea", 7, seen)
    assert seen[-1] == ([7], [6])


# ----------------------------------------------------------------------------- KeepBest: retention by a metric
def _m(**values: float) -> dict[int, dict[str, float]]:
    return {int(k[1:]): {"val_loss": v} for k, v in values.items()}


def test_keep_best_is_pure_over_steps_and_metrics() -> None:
    metrics = _m(s10=0.5, s20=0.3, s30=0.9, s40=0.3, s50=float("nan"))
    assert KeepBest("val_loss", k=2).keep_scored([10, 20, 30, 40, 50], metrics) == {20, 40}
    assert KeepBest("val_loss", k=1).keep_scored([10, 20, 30, 40], metrics) == {20}  # a tie keeps the older
    assert KeepBest("val_loss", k=2, mode="max").keep_scored([10, 20, 30, 40, 50], metrics) == {30, 10}
    assert KeepBest("val_loss", k=5).keep_scored([10, 60], metrics) == {10}  # no value: not a candidate
    assert KeepBest("val_loss").keep([10, 20]) == set()  # no metrics known: nothing is best
    assert KeepBest("acc").keep_scored([10, 20], metrics) == set()


def test_keep_best_composes_and_the_newest_is_always_kept() -> None:
    policy = KeepLast(1) | KeepBest("val_loss", k=2)
    assert isinstance(policy, KeepAny) and policy.metric_names == ("val_loss",)
    metrics = _m(s10=0.2, s20=0.1, s30=0.7, s40=0.8)
    assert plan_deletions([10, 20, 30, 40], policy, newest_valid=40, metrics=metrics) == [30]
    # KeepBest alone: the newest is still kept for resume
    assert plan_deletions([10, 20, 30, 40], KeepBest("val_loss"), newest_valid=40, metrics=metrics) == [10, 30]
    # applied save after save (top-k is monotone): deleting what is dropped never changes the later answer
    kept: list[int] = []
    for step in (10, 20, 30, 40):
        kept.append(step)
        for gone in plan_deletions(kept, policy, newest_valid=step, metrics=metrics):
            kept.remove(gone)
    assert kept == [10, 20, 40]


def test_keep_best_spec_round_trips_and_refuses_nonsense() -> None:
    for spec in ("best=val_loss:2:min", "last=1,best=acc:3:max", "best=eval/loss:1:min"):
        assert parse_retention(spec).spec == spec
    assert parse_retention("best=val_loss") == KeepBest("val_loss", 1, "min")
    for spec in ("best=val_loss:0", "best=val_loss:2:up", "best=:2", "best=a b:1"):
        with pytest.raises(BadInput):
            parse_retention(spec)
    with pytest.raises(ValueError):
        KeepBest("val_loss", mode="lowest")
    with pytest.raises(TypeError):
        KeepBest(3)  # type: ignore[arg-type]


def test_a_checkpointer_keeps_the_best_by_val_loss_across_a_resume(tmp_path) -> None:
    """The real thing: generations on disk, the metric reported through step_done, a new process-like resume."""
    from support.tiny import tiny_state

    import ripresa
    from ripresa.session.checkpointer import METRICS_NAME

    def state() -> ripresa.TrainingState:
        return tiny_state((2, 1), optimizer="sgd", lr=0.1)

    val = {2: 0.9, 4: 0.2, 6: 0.5, 8: 0.7, 10: 0.1, 12: 0.8}
    policy = KeepLast(1) | KeepBest("val_loss", k=2, mode="min")

    def steps(ckpt, first: int, last: int) -> None:
        for s in range(first, last + 1):
            extra = {"val_loss": val[s]} if s in val and s != 8 else {}
            ckpt.step_done(s, loss=1.0 / s, **extra)

    run = tmp_path / "run"
    ckpt = ripresa.Checkpointer(run, state(), every=2, retention=policy, asynchronous=False, handle_signals=False)
    assert ckpt.resume() == 0
    steps(ckpt, 1, 8)  # val_loss reported at 2, 4, 6 (not 8: step 8 carries 6's value, 0.5)
    ckpt.close(final_save=False)
    on_disk = sorted(int(p.name[5:11]) for p in run.glob("step_*.safetensors"))
    assert on_disk == [4, 6, 8], on_disk  # 4 (0.2) and 6/8 (0.5: the tie keeps 6) best; 8 newest
    recorded = json.loads((run / METRICS_NAME).read_text())["steps"]
    assert recorded["8"] == {"val_loss": 0.5} and recorded["4"] == {"val_loss": 0.2}
    ckpt = ripresa.Checkpointer(run, state(), every=2, retention=policy, asynchronous=False, handle_signals=False)
    assert ckpt.resume() == 8
    steps(ckpt, 9, 12)  # 10: 0.1 (the best), 12: 0.8
    ckpt.close(final_save=False)
    on_disk = sorted(int(p.name[5:11]) for p in run.glob("step_*.safetensors"))
    assert on_disk == [4, 10, 12], on_disk
    # a hostile metrics file is refused before anything is deleted on its word
    (run / METRICS_NAME).write_text('{"schema": "ripresa.retention_metrics/1", "steps": {"4": {"val_loss": "x"}}}')
    with pytest.raises(BadInput, match="retention metrics"):
        ripresa.Checkpointer(run, state(), every=2, retention=policy, handle_signals=False)
    assert sorted(int(p.name[5:11]) for p in run.glob("step_*.safetensors")) == [4, 10, 12]
