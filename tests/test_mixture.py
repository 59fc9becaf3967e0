"""The data mixture: policy checks, the box projection, caps and floors held
under an adversarial reward, exact resume, JSON round trips, zombie arms."""

from __future__ import annotations

import copy
import json
import math
import pickle
import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ripresa.engine.mixture import (
    SUM_TOL,
    BanditMixture,
    MixturePolicy,
    PolicyChanged,
    ZombieArmWarning,
    parse_policy_args,
    project_to_box,
)
from ripresa.errors import BadInput, SchemaError

ARMS = ["code", "web", "books"]


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def bits(x: float | None) -> str | None:
    return None if x is None else float(x).hex()


# ---- policy validation ----------------------------------------------------------


@pytest.mark.parametrize(
    ("floors", "caps", "words"),
    [
        ({"wiki": 0.1}, {}, ["'wiki'", "not a data source"]),
        ({}, {"wiki": 0.5}, ["'wiki'", "not a data source"]),
        ({"code": 0.6}, {"code": 0.4}, ["'code'", "above its cap", "0.6", "0.4"]),
        ({"code": 0.5, "web": 0.4, "books": 0.3}, {}, ["floors sum", "1.2", "code=0.5"]),
        ({}, {"code": 0.3, "web": 0.3, "books": 0.3}, ["caps sum", "0.9", "books=0.3"]),
        ({"code": 1.5}, {}, ["'code'", "[0, 1]", "1.5"]),
        ({}, {"web": -0.1}, ["'web'", "[0, 1]", "-0.1"]),
        ({"web": float("nan")}, {}, ["'web'", "nan"]),
        ({}, {"web": float("inf")}, ["'web'", "inf"]),
        ({"web": True}, {}, ["'web'", "number"]),
        ({"web": "0.1"}, {}, ["'web'", "number"]),
    ],
)
def test_invalid_policies_are_refused_by_name(floors, caps, words):
    with pytest.raises(BadInput) as info:
        MixturePolicy(floors=floors, caps=caps).validate(ARMS, source="config.json")
    text = str(info.value)
    for w in words:
        assert w in text, (w, text)


def test_validation_names_the_file():
    with pytest.raises(BadInput) as info:
        MixturePolicy(caps={"wiki": 0.5}).validate(ARMS, source="runs/a/config.json")
    assert info.value.file == "runs/a/config.json"
    assert info.value.hint


@pytest.mark.parametrize(
    ("floors", "caps"),
    [
        ({}, {}),
        ({"code": 0.2, "web": 0.3, "books": 0.5}, {}),  # floors sum to exactly 1
        ({}, {"code": 0.2, "web": 0.3, "books": 0.5}),  # caps sum to exactly 1
        ({"code": 0.1, "web": 0.2, "books": 0.7}, {}),  # 1.0000000000000002 in floats
        ({"web": 0.0}, {"code": 0.0}),  # a cap of 0 disables an arm
        ({"code": 0.3}, {"code": 0.3}),  # a fixed share
    ],
)
def test_valid_policies(floors, caps):
    MixturePolicy(floors=floors, caps=caps).validate(ARMS)


def test_parse_policy_args_and_dict_round_trip():
    p = parse_policy_args(caps=["code=0.5", " web = 0.8"], floors=["books=0.2"])
    assert dict(p.caps) == {"code": 0.5, "web": 0.8}
    assert dict(p.floors) == {"books": 0.2}
    p.validate(ARMS)
    d = p.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert MixturePolicy.from_dict(json.loads(json.dumps(d))) == p
    assert hash(MixturePolicy.from_dict(d)) == hash(p)
    assert parse_policy_args([], []) == MixturePolicy()


@pytest.mark.parametrize(
    ("caps", "floors", "words"),
    [
        (["code"], [], ["--cap", "ARM=VALUE"]),
        (["=0.5"], [], ["--cap", "names no arm"]),
        (["code=half"], [], ["--cap", "not a number", "half"]),
        (["code=0.5", "code=0.6"], [], ["--cap", "twice", "'code'"]),
        ([], ["code=2"], ["--floor", "'code'", "[0, 1]"]),
        ([], ["code=nan"], ["--floor", "'code'", "nan"]),
        (["code=0.1"], ["code=0.2"], ["'code'", "above its cap"]),
    ],
)
def test_parse_policy_args_errors(caps, floors, words):
    with pytest.raises(BadInput) as info:
        parse_policy_args(caps=caps, floors=floors)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_policy_from_dict_errors_name_the_file():
    with pytest.raises(BadInput) as info:
        MixturePolicy.from_dict({"caps": {}, "limits": {}}, source="config.json")
    assert info.value.file == "config.json" and "limits" in str(info.value)
    with pytest.raises(BadInput) as info:
        MixturePolicy.from_dict({"caps": {"web": 3}}, source="config.json")
    assert info.value.file == "config.json"


# ---- projection ------------------------------------------------------------------


@st.composite
def boxes(draw):
    n = draw(st.integers(1, 6))
    unit = st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 1.0))
    raw_lo = [draw(unit) for _ in range(n)]
    scale = draw(st.one_of(st.just(1.0), st.floats(0.0, 1.0)))
    total = math.fsum(raw_lo)
    lo = [x * scale / total if total > 1.0 else x * scale for x in raw_lo]
    lo = [min(1.0, max(0.0, x)) for x in lo]
    widths = [draw(unit) for _ in range(n)]
    hi = [min(1.0, a + w * (1.0 - a)) for a, w in zip(lo, widths, strict=True)]
    assume(math.fsum(lo) <= 1.0 + SUM_TOL and math.fsum(hi) >= 1.0 - SUM_TOL)
    q = [draw(st.floats(-2.0, 2.0)) for _ in range(n)]
    return q, lo, hi


def _check_in_box(p, lo, hi):
    assert all(a <= x <= b for x, a, b in zip(p, lo, hi, strict=True)), (p, lo, hi)
    assert abs(math.fsum(p) - 1.0) <= SUM_TOL, math.fsum(p)


@settings(max_examples=400, deadline=None)
@given(boxes())
def test_projection_is_feasible_idempotent_and_optimal(box):
    q, lo, hi = box
    p = project_to_box(q, lo, hi)
    _check_in_box(p, lo, hi)
    assert project_to_box(p, lo, hi) == p  # idempotent, bit for bit
    # optimality (KKT): p_i = clip(q_i + lam, lo_i, hi_i) for one water level lam
    free = [x - y for x, y, a, b in zip(p, q, lo, hi, strict=True) if a < x < b]
    if free:
        lam = sum(free) / len(free)
        assert max(free) - min(free) <= 1e-9
        for x, y, a, b in zip(p, q, lo, hi, strict=True):
            if x == a and a < b:
                assert y + lam <= a + 1e-9
            if x == b and a < b:
                assert y + lam >= b - 1e-9


@settings(max_examples=200, deadline=None)
@given(boxes(), st.data())
def test_projection_leaves_feasible_points_unchanged(box, data):
    _, lo, hi = box
    # a feasible point: start from lo and fill the rest greedily in a drawn order
    order = data.draw(st.permutations(range(len(lo))))
    p = list(lo)
    rest = 1.0 - math.fsum(p)
    for i in order:
        add = max(0.0, min(rest, hi[i] - p[i]))
        p[i] += add
        rest -= add
    p = [min(b, max(a, x)) for x, a, b in zip(p, lo, hi, strict=True)]
    assume(abs(math.fsum(p) - 1.0) <= SUM_TOL)
    assert project_to_box(p, lo, hi) == p


@settings(max_examples=200, deadline=None)
@given(boxes())
def test_projection_matches_a_bisection_reference(box):
    q, lo, hi = box
    assume(math.fsum(lo) < 1.0 - 1e-6 and math.fsum(hi) > 1.0 + 1e-6)
    a, b = -4.0, 4.0
    for _ in range(200):
        m = (a + b) / 2
        if math.fsum(min(h, max(f, x + m)) for x, f, h in zip(q, lo, hi, strict=True)) < 1.0:
            a = m
        else:
            b = m
    ref = [min(h, max(f, x + a)) for x, f, h in zip(q, lo, hi, strict=True)]
    p = project_to_box(q, lo, hi)
    assert max(abs(x - y) for x, y in zip(p, ref, strict=True)) <= 1e-9


def test_projection_examples():
    assert project_to_box([0.9, 0.05, 0.05], [0, 0.3, 0], [0.6, 1, 1]) == pytest.approx(
        [0.6, 0.3, 0.1]
    )
    assert project_to_box([1.0], [0.0], [1.0]) == [1.0]
    assert project_to_box([0.5, 0.5], [0.5, 0.5], [1, 1]) == [0.5, 0.5]
    assert project_to_box([0.9, 0.1], [0.7, 0.3], [1, 1]) == [0.7, 0.3]  # floors sum to 1
    assert project_to_box([0.9, 0.1], [0, 0], [0.25, 0.75]) == [0.25, 0.75]  # caps sum to 1
    with pytest.raises(ValueError):
        project_to_box([0.5, 0.5], [0.6, 0.6], [1, 1])


# ---- the bandit -------------------------------------------------------------------


def test_probabilities_follow_rewards_within_the_policy():
    m = BanditMixture(ARMS, MixturePolicy(), rng())
    p = m.probabilities()
    assert p == pytest.approx({a: 1 / 3 for a in ARMS})
    assert m.update("web", 3.0) == 0.0  # first observation: the baseline only
    assert m.update("web", 2.0) == 1.0  # the loss dropped by 1
    p = m.probabilities()
    assert p["web"] > p["code"] == pytest.approx(p["books"])
    assert math.fsum(p.values()) == pytest.approx(1.0, abs=1e-12)


def test_choose_draws_exactly_once_from_the_generator():
    g = rng(5)
    m = BanditMixture(ARMS, MixturePolicy(), g)
    twin = rng(5)
    for _ in range(50):
        m.choose()
        twin.random()
    assert g.random() == twin.random()


def test_cap_zero_arm_is_never_chosen():
    m = BanditMixture(ARMS, MixturePolicy(caps={"web": 0.0}), rng(1))
    assert all(m.choose() != "web" for _ in range(2000))


def test_caps_and_floors_hold_against_an_adversarial_reward():
    """'code' always shows huge learning progress: the bandit wants it 100 %.
    Its cap (0.6) and the floor of 'web' (0.3) must hold over 20,000 draws."""
    policy = MixturePolicy(floors={"web": 0.3}, caps={"code": 0.6})
    m = BanditMixture(ARMS, policy, rng(7))
    n_code = 0
    for _ in range(20_000):
        arm = m.choose()
        if arm == "code":
            n_code += 1
            m.update(arm, -1000.0 * n_code)  # ever-falling loss: a huge reward
        elif arm == "web":
            m.update(arm, 5.0 + 0.001 * m.pulls()["web"])  # rising loss: negative reward
        else:
            m.update(arm, 5.0)
    pref = m.preferences()
    assert pref["code"] > 0.9  # what the bandit would do without the policy
    p = m.probabilities()
    assert p == pytest.approx({"code": 0.6, "web": 0.3, "books": 0.1}, abs=1e-12)
    s = m.shares()
    assert abs(s["code"] - 0.6) <= 0.02
    assert abs(s["web"] - 0.3) <= 0.02
    assert abs(s["books"] - 0.1) <= 0.02
    assert m.total_pulls == 20_000 and m.steps_in_phase == 20_000


def _loss(arm: str, t: int) -> float:
    base = {"code": 4.0, "web": 3.0, "books": 5.0}[arm]
    return base * math.exp(-t / (300.0 if arm == "code" else 900.0)) + 0.01 * math.sin(7 * t)


def _run(m: BanditMixture, start: int, n: int) -> list[str]:
    out = []
    for t in range(start, start + n):
        arm = m.choose()
        m.update(arm, _loss(arm, t))
        out.append(arm)
    return out


def test_exact_resume_through_json():
    policy = MixturePolicy(floors={"books": 0.1}, caps={"code": 0.7})
    straight = BanditMixture(ARMS, policy, rng(42), temperature=0.05)
    seq_straight = _run(straight, 0, 1000)

    first = BanditMixture(ARMS, policy, rng(42), temperature=0.05)
    seq_first = _run(first, 0, 500)
    saved = json.dumps({"mixture": first.state_dict(), "gen": first.generator.bit_generator.state})

    doc = json.loads(saved)
    resumed = BanditMixture(list(reversed(ARMS)), policy, rng(999), temperature=0.05)
    resumed.generator.bit_generator.state = doc["gen"]
    resumed.load_state_dict(doc["mixture"])
    assert resumed.dropped_arms == [] and resumed.added_arms == []
    seq_second = _run(resumed, 500, 500)

    assert seq_first + seq_second == seq_straight
    assert len(set(seq_straight)) == 3
    a, b = resumed.state_dict(), straight.state_dict()
    assert a == b
    assert json.dumps(a) == json.dumps(b)
    for arm in ARMS:
        for key in ("ema_reward", "ema_loss", "last_reward"):
            assert bits(a["stats"][arm][key]) == bits(b["stats"][arm][key])
    assert resumed.generator.random() == straight.generator.random()


def test_state_dict_is_json_and_round_trips_bit_exactly():
    m = BanditMixture(ARMS, MixturePolicy(caps={"web": 0.5}), rng(3), phase=2)
    m.update("books", 1.0)  # an arm with one observation, one never seen
    _run(m, 0, 37)
    sd = m.state_dict()
    text = json.dumps(sd, allow_nan=False)
    back = json.loads(text)
    assert back == sd
    for arm in ARMS:
        for key in ("ema_reward", "ema_loss", "last_reward"):
            assert bits(back["stats"][arm][key]) == bits(sd["stats"][arm][key])
    other = BanditMixture(ARMS, MixturePolicy(caps={"web": 0.5}), rng(4))
    other.load_state_dict(back)
    assert other.state_dict() == sd
    assert other.phase == 2 and other.steps_in_phase == 38
    assert other.probabilities() == m.probabilities()
    fresh = BanditMixture(ARMS, MixturePolicy(), rng(0)).state_dict()
    assert all(fresh["stats"][a]["ema_loss"] is None for a in ARMS)
    json.dumps(fresh, allow_nan=False)


def test_state_dict_holds_no_generator_state():
    m = BanditMixture(ARMS, MixturePolicy(), rng(0))
    text = json.dumps(m.state_dict())
    assert "PCG64" not in text and "bit_generator" not in text
    assert set(m.state_dict()) == {
        "kind",
        "version",
        "arms",
        "stats",
        "policy",
        "phase",
        "steps_in_phase",
        "total_pulls",
        "hyper",
    }


def test_zombie_arm_is_dropped_with_a_warning():
    old = BanditMixture(ARMS + ["repo-docstrings"], MixturePolicy(), rng(0))
    _run_all = [old.choose() for _ in range(40)]
    assert "repo-docstrings" in _run_all
    sd = old.state_dict()
    sd["stats"]["repo-docstrings"]["ema_reward"] = 1.546
    zombie_pulls = sd["stats"]["repo-docstrings"]["pulls"]

    m = BanditMixture(ARMS + ["papers"], MixturePolicy(), rng(1))
    with pytest.warns(ZombieArmWarning, match="repo-docstrings") as rec:
        m.load_state_dict(json.loads(json.dumps(sd)), source="runs/a/.state.json")
    assert "1.546" in str(rec[0].message) and ".state.json" in str(rec[0].message)
    assert m.dropped_arms == [
        {"arm": "repo-docstrings", "pulls": zombie_pulls, "ema_reward": 1.546}
    ]
    assert m.added_arms == ["papers"]
    assert "repo-docstrings" not in m.state_dict()["stats"]
    assert "repo-docstrings" not in m.probabilities()
    assert m.total_pulls == 40 - zombie_pulls
    assert m.stats()["papers"]["pulls"] == 0 and m.stats()["papers"]["ema_loss"] is None
    chosen = {m.choose() for _ in range(3000)}
    assert "repo-docstrings" not in chosen and chosen == set(ARMS) | {"papers"}
    with pytest.raises(BadInput):
        m.update("repo-docstrings", 1.0)


def test_zombie_bounds_in_the_saved_policy_do_not_count_as_a_policy_change():
    old = BanditMixture(
        ARMS + ["repo-docstrings"], MixturePolicy(caps={"repo-docstrings": 0.2}), rng(0)
    )
    m = BanditMixture(ARMS, MixturePolicy(), rng(0))
    with pytest.warns(ZombieArmWarning):
        m.load_state_dict(old.state_dict())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "x", None, 1e308])
def test_non_finite_loss_is_refused_without_changing_state(bad):
    m = BanditMixture(ARMS, MixturePolicy(), rng(0))
    m.update("web", -1e308)
    _run(m, 0, 20)
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(BadInput) as info:
        m.update("web", bad)
    assert "'web'" in str(info.value)
    assert m.state_dict() == before


def test_policy_change_is_refused_unless_allowed():
    m = BanditMixture(ARMS, MixturePolicy(caps={"code": 0.5}), rng(0))
    _run(m, 0, 30)
    sd = m.state_dict()
    new = BanditMixture(ARMS, MixturePolicy(caps={"code": 0.4}, floors={"web": 0.1}), rng(0))
    before = new.state_dict()
    with pytest.raises(PolicyChanged) as info:
        new.load_state_dict(sd, source=".state.json")
    err = info.value
    assert isinstance(err, BadInput) and err.exit_code == 2
    assert "pivot" in err.hint and "code" in str(err.found) and err.file == ".state.json"
    assert new.state_dict() == before
    new.load_state_dict(sd, allow_policy_change=True)
    assert new.policy == MixturePolicy(caps={"code": 0.4}, floors={"web": 0.1})
    assert new.state_dict()["stats"] == sd["stats"]
    assert new.probabilities()["code"] <= 0.4 and new.probabilities()["web"] >= 0.1


def test_hyper_parameter_change_is_refused_unless_allowed():
    sd = BanditMixture(ARMS, MixturePolicy(), rng(0), temperature=0.1).state_dict()
    m = BanditMixture(ARMS, MixturePolicy(), rng(0), temperature=0.2)
    with pytest.raises(PolicyChanged, match="hyper-parameters"):
        m.load_state_dict(sd)
    m.load_state_dict(sd, allow_policy_change=True)
    assert m.temperature == 0.2


def test_new_phase_is_a_fresh_bandit():
    m = BanditMixture(ARMS, MixturePolicy(caps={"code": 0.5}), rng(0), phase=1)
    _run(m, 0, 50)
    n = m.new_phase(MixturePolicy(floors={"books": 0.4}))
    assert n.phase == 2 and n.steps_in_phase == 0 and n.total_pulls == 0
    assert n.generator is m.generator
    assert all(s["pulls"] == 0 and s["ema_loss"] is None for s in n.stats().values())
    assert n.probabilities()["books"] >= 0.4


def _damaged(mutate):
    sd = BanditMixture(ARMS, MixturePolicy(), rng(0)).state_dict()
    sd = json.loads(json.dumps(sd))
    mutate(sd)
    return sd


@pytest.mark.parametrize(
    "mutate",
    [
        lambda sd: sd.pop("stats"),
        lambda sd: sd.update(kind="something"),
        lambda sd: sd.update(version=99),
        lambda sd: sd.update(arms="code"),
        lambda sd: sd.update(arms=["code", "code", "web"]),
        lambda sd: sd["stats"].pop("web"),
        lambda sd: sd["stats"]["web"].update(pulls=-1),
        lambda sd: sd["stats"]["web"].update(pulls=1.5),
        lambda sd: sd["stats"]["web"].update(pulls=True),
        lambda sd: sd["stats"]["web"].update(ema_reward="1.0"),
        lambda sd: sd["stats"]["web"].update(ema_reward=None),
        lambda sd: sd["stats"]["web"].update(ema_loss=float("nan")),
        lambda sd: sd["stats"]["web"].pop("last_reward"),
        lambda sd: sd.update(total_pulls=7),
        lambda sd: sd.update(phase=-1),
        lambda sd: sd.update(policy={"caps": {"web": 2.0}}),
        lambda sd: sd.update(hyper={"temperature": 0.1}),
        lambda sd: sd.update(hyper={"reward_ema": 0.9, "temperature": "hot", "exploration": 0.1}),
    ],
)
def test_malformed_state_is_a_schema_error_and_changes_nothing(mutate):
    m = BanditMixture(ARMS, MixturePolicy(), rng(0))
    _run(m, 0, 10)
    before = m.state_dict()
    with pytest.raises(SchemaError) as info:
        m.load_state_dict(_damaged(mutate), source=".state.json")
    assert info.value.file == ".state.json"
    assert m.state_dict() == before


def test_constructor_errors():
    with pytest.raises(BadInput):
        BanditMixture([], MixturePolicy(), rng())
    with pytest.raises(BadInput, match="unique"):
        BanditMixture(["a", "a"], MixturePolicy(), rng())
    with pytest.raises(BadInput, match="Generator"):
        BanditMixture(ARMS, MixturePolicy(), np.random.RandomState(0))  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="not a data source"):
        BanditMixture(ARMS, MixturePolicy(caps={"wiki": 0.5}), rng())
    with pytest.raises(BadInput, match="temperature"):
        BanditMixture(ARMS, MixturePolicy(), rng(), temperature=0.0)
    with pytest.raises(BadInput, match="reward_ema"):
        BanditMixture(ARMS, MixturePolicy(), rng(), reward_ema=1.0)


def test_no_warning_on_a_clean_load():
    m = BanditMixture(ARMS, MixturePolicy(), rng(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BanditMixture(ARMS, MixturePolicy(), rng(1)).load_state_dict(m.state_dict())


def test_policy_is_immutable_and_copies():
    p = MixturePolicy(floors={"web": 0.2}, caps={"code": 0.5})
    with pytest.raises(TypeError):
        p.caps["code"] = 0.9  # type: ignore[index]
    assert copy.deepcopy(p) == p and pickle.loads(pickle.dumps(p)) == p
    assert copy.deepcopy(BanditMixture(ARMS, p, rng()).policy) == p
