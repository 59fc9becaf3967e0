"""The data mixture: a multi-armed bandit that picks the source of each batch.

Before each step the trainer asks :meth:`BanditMixture.choose` for an arm,
trains on its batch and reports the loss with :meth:`BanditMixture.update`; the
bandit favours the arms where the loss drops most, within the operator's caps
and floors (:class:`MixturePolicy`). One generator draw per choice; the state
is JSON and round-trips bit-exactly. Reward, probabilities, draws, saving,
zombie arms and policy changes: docs/ENGINE.md, "The data mixture".
"""

from __future__ import annotations

import math
import operator
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ..core.numbers import checked_number
from ..errors import BadInput, RipresaError, SchemaError

__all__ = [
    "BanditMixture",
    "MixturePolicy",
    "PolicyChanged",
    "STATE_KIND",
    "STATE_VERSION",
    "ZombieArmWarning",
    "parse_policy_args",
    "project_to_box",
]

#: ``kind`` and ``version`` written in every mixture state.
STATE_KIND = "ripresa.engine.mixture"
STATE_VERSION = 1

#: Tolerance on "sums to 1" (policy sums and projected probabilities).
SUM_TOL = 1e-9

_PIVOT_HINT = (
    "a policy change is a pivot: archive .state.json and start a fresh bandit under the new "
    "policy (or pass allow_policy_change=True to keep the learned statistics)"
)


class ZombieArmWarning(UserWarning):
    """A saved mixture state names an arm that is no longer a data source."""


class PolicyChanged(BadInput):
    """A saved mixture state was learned under another policy or hyper-parameters."""


# ---- small checks ---------------------------------------------------------------


def _fraction(value: object, what: str, *, source: str | Path | None = None) -> float:
    """``value`` as a finite float in [0, 1]; bools and non-numbers are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise BadInput(
            f"{what} must be a number in [0, 1]",
            file=source,
            expected="a number in [0, 1]",
            found=repr(value),
        )
    if isinstance(value, np.integer | np.floating):
        value = value.item()
    try:  # the one checked conversion (docs/FAULTS.md, "Numbers read from files"): 10**400 is no OverflowError
        return float(checked_number(value, file=source, field=what, lo=0.0, hi=1.0, integer=False, error=BadInput))
    except BadInput as exc:
        raise BadInput(f"{what} is outside [0, 1]", file=source, expected="a finite number in [0, 1]",
                       found=exc.found) from None


def _arm_name(value: object, what: str, *, source: str | Path | None = None) -> str:
    if not isinstance(value, str) or not value or value != value.strip():
        raise BadInput(
            f"{what} must be a non-empty name without surrounding spaces",
            file=source,
            expected="a data-source name",
            found=repr(value),
        )
    return value


# ---- policy ---------------------------------------------------------------------


@dataclass(frozen=True)
class MixturePolicy:
    """Caps and floors on the share of each arm: ``floor <= p(arm) <= cap``.

    An arm missing from ``floors`` has floor 0; one missing from ``caps`` has
    cap 1. Values are checked on construction (finite, in [0, 1], floor <= cap
    for every named arm); :meth:`validate` checks the policy against the arms
    of a run (known names, sums).
    """

    floors: Mapping[str, float] = field(default_factory=dict)
    caps: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for attr in ("floors", "caps"):
            raw = getattr(self, attr)
            if not isinstance(raw, Mapping):
                raise BadInput(
                    f"policy {attr} must be a mapping from arm to number",
                    expected="{arm: number}",
                    found=type(raw).__name__,
                )
            what = attr[:-1]
            clean = {
                _arm_name(k, f"{what} arm"): _fraction(v, f"{what} of arm {k!r}")
                for k, v in raw.items()
            }
            object.__setattr__(self, attr, MappingProxyType(dict(sorted(clean.items()))))
        for arm in sorted(set(self.floors) | set(self.caps)):
            lo, hi = self.floor(arm), self.cap(arm)
            if lo > hi:
                raise BadInput(
                    f"floor of arm {arm!r} is above its cap",
                    expected="floor <= cap",
                    found=f"floor {lo!r} > cap {hi!r}",
                    hint=f"lower the floor or raise the cap of {arm!r}",
                )

    def __reduce__(self) -> tuple[Any, ...]:  # mappingproxy does not pickle
        return (type(self), (dict(self.floors), dict(self.caps)))

    def __hash__(self) -> int:
        return hash((tuple(self.floors.items()), tuple(self.caps.items())))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MixturePolicy):
            return NotImplemented
        return dict(self.floors) == dict(other.floors) and dict(self.caps) == dict(other.caps)

    def floor(self, arm: str) -> float:
        return float(self.floors.get(arm, 0.0))

    def cap(self, arm: str) -> float:
        return float(self.caps.get(arm, 1.0))

    def bounds(self, arms: Sequence[str]) -> tuple[list[float], list[float]]:
        """``(floors, caps)`` of ``arms``, in that order, defaults filled in."""
        return [self.floor(a) for a in arms], [self.cap(a) for a in arms]

    def same_bounds(self, other: MixturePolicy, arms: Sequence[str]) -> bool:
        """True when both policies give every arm of ``arms`` the same floor and cap."""
        return self.bounds(arms) == other.bounds(arms)

    def validate(self, arms: Sequence[str], source: str | Path | None = None) -> None:
        """Raise :class:`BadInput` unless this policy is feasible for ``arms``.

        Every named arm must be one of ``arms``; floors must sum to at most 1
        and caps to at least 1 (within ``SUM_TOL``), so that at least one
        mixture satisfies every bound.
        """
        known = set(arms)
        for attr in ("floors", "caps"):
            for arm in getattr(self, attr):
                if arm not in known:
                    raise BadInput(
                        f"policy sets a {attr[:-1]} for arm {arm!r}, which is not a data source",
                        file=source,
                        expected=f"one of {sorted(known)}",
                        found=repr(arm),
                        hint="remove it from the caps/floors (a source that no longer exists "
                        "is a zombie arm) or add the source",
                    )
        for arm in arms:  # also guards policies built around __post_init__
            if self.floor(arm) > self.cap(arm):
                raise BadInput(
                    f"floor of arm {arm!r} is above its cap",
                    file=source,
                    expected="floor <= cap",
                    found=f"floor {self.floor(arm)!r} > cap {self.cap(arm)!r}",
                )
        floors, caps = self.bounds(arms)
        s_lo, s_hi = math.fsum(floors), math.fsum(caps)
        if s_lo > 1.0 + SUM_TOL:
            named = ", ".join(f"{a}={self.floor(a):g}" for a in arms if self.floor(a) > 0)
            raise BadInput(
                f"floors sum to {s_lo:g} > 1: no mixture can give every arm its floor",
                file=source,
                expected="sum of floors <= 1",
                found=f"sum {s_lo!r} ({named})",
                hint="lower some floors",
            )
        if s_hi < 1.0 - SUM_TOL:
            named = ", ".join(f"{a}={self.cap(a):g}" for a in arms)
            raise BadInput(
                f"caps sum to {s_hi:g} < 1: the arms cannot fill every batch",
                file=source,
                expected="sum of caps >= 1",
                found=f"sum {s_hi!r} ({named})",
                hint="raise some caps (an arm without a cap has cap 1) or add sources",
            )

    def to_dict(self) -> dict[str, dict[str, float]]:
        """JSON primitives, for ``config.json``: ``{"floors": {...}, "caps": {...}}``."""
        return {"floors": dict(self.floors), "caps": dict(self.caps)}

    @classmethod
    def from_dict(cls, data: object, source: str | Path | None = None) -> MixturePolicy:
        """The inverse of :meth:`to_dict`; a missing key means no bound of that kind."""
        if not isinstance(data, Mapping):
            raise BadInput(
                "mixture policy must be an object",
                file=source,
                expected='{"floors": {...}, "caps": {...}}',
                found=type(data).__name__,
            )
        extra = sorted(set(data) - {"floors", "caps"})
        if extra:
            raise BadInput(
                "mixture policy has unknown keys",
                file=source,
                expected='only "floors" and "caps"',
                found=extra,
            )
        try:
            return cls(floors=data.get("floors", {}), caps=data.get("caps", {}))
        except RipresaError as e:
            if source is not None and e.file is None:
                e.file = str(source)
            raise


def _parse_terms(items: Sequence[str] | None, flag: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items or ():
        if not isinstance(item, str) or "=" not in item:
            raise BadInput(
                f"{flag} {item!r} is not of the form ARM=VALUE",
                expected=f"{flag} ARM=VALUE, e.g. {flag} web=0.5",
                found=repr(item),
            )
        arm, _, text = item.rpartition("=")
        arm = arm.strip()
        if not arm:
            raise BadInput(f"{flag} {item!r} names no arm", expected="ARM=VALUE", found=repr(item))
        try:
            value = float(text.strip())
        except ValueError:
            raise BadInput(
                f"{flag} {item!r}: the value is not a number",
                expected="a number in [0, 1]",
                found=repr(text),
            ) from None
        if arm in out:
            raise BadInput(
                f"{flag} given twice for arm {arm!r}",
                expected=f"one {flag} per arm",
                found=f"{out[arm]!r} and {value!r}",
            )
        out[arm] = _fraction(value, f"{flag} of arm {arm!r}")
    return out


def parse_policy_args(
    caps: Sequence[str] | None = None, floors: Sequence[str] | None = None
) -> MixturePolicy:
    """A policy from CLI terms ``["web=0.5", ...]`` given to ``--cap`` and ``--floor``.

    Syntax and values are checked here; call :meth:`MixturePolicy.validate`
    with the run's arms to check names and sums.
    """
    return MixturePolicy(floors=_parse_terms(floors, "--floor"), caps=_parse_terms(caps, "--cap"))


# ---- projection ------------------------------------------------------------------


def _feasible(p: Sequence[float], lo: Sequence[float], hi: Sequence[float]) -> bool:
    return all(a <= x <= b for x, a, b in zip(p, lo, hi, strict=True)) and (
        abs(math.fsum(p) - 1.0) <= SUM_TOL
    )


def project_to_box(q: Sequence[float], lo: Sequence[float], hi: Sequence[float]) -> list[float]:
    """Euclidean projection of ``q`` onto ``{p : lo <= p <= hi, sum(p) = 1}``.

    The solution is ``p_i = clip(q_i + lam, lo_i, hi_i)`` for the water level
    ``lam`` at which the sum is 1. The sum is piecewise linear and
    non-decreasing in ``lam`` with breakpoints at ``lo_i - q_i`` and
    ``hi_i - q_i``; the bracketing pair of sorted breakpoints is found and the
    linear piece between them solved exactly. Rounding left in the sum
    (a few ulps) is then given to arms with room, never crossing a bound.

    A point that is already feasible is returned unchanged (so the projection
    is idempotent). Requires ``lo <= hi``, ``sum(lo) <= 1 <= sum(hi)``.
    """
    q = [float(x) for x in q]
    lo = [float(x) for x in lo]
    hi = [float(x) for x in hi]
    n = len(q)
    if not (n == len(lo) == len(hi)) or n == 0:
        raise ValueError("q, lo and hi must be non-empty and of the same length")
    if not all(math.isfinite(x) for x in (*q, *lo, *hi)):
        raise ValueError("q, lo and hi must be finite")
    if any(a > b for a, b in zip(lo, hi, strict=True)):
        raise ValueError("every lower bound must be <= its upper bound")
    s_lo, s_hi = math.fsum(lo), math.fsum(hi)
    if s_lo > 1.0 + SUM_TOL or s_hi < 1.0 - SUM_TOL:
        raise ValueError(f"infeasible box: sum(lo)={s_lo!r}, sum(hi)={s_hi!r}")
    if _feasible(q, lo, hi):
        return q
    if s_lo >= 1.0:  # only the floors fit (within SUM_TOL)
        return lo
    if s_hi <= 1.0:  # only the caps fit
        return hi

    def clipped(lam: float) -> list[float]:
        return [min(b, max(a, x + lam)) for x, a, b in zip(q, lo, hi, strict=True)]

    def total(lam: float) -> float:
        return math.fsum(clipped(lam))

    points = sorted(
        {a - x for x, a in zip(q, lo, strict=True)} | {b - x for x, b in zip(q, hi, strict=True)}
    )
    # total(points[0]) == s_lo < 1 and total(points[-1]) == s_hi > 1: bisect the breakpoints
    i, j = 0, len(points) - 1
    while j - i > 1:
        m = (i + j) // 2
        if total(points[m]) <= 1.0:
            i = m
        else:
            j = m
    l0, l1 = points[i], points[j]
    f0, f1 = total(l0), total(l1)
    lam = l0 if f1 <= f0 else l0 + (1.0 - f0) * (l1 - l0) / (f1 - f0)
    lam = min(max(lam, l0), l1)
    p = clipped(lam)

    # hand the remaining rounding (a few ulps) to arms with room, never crossing a bound:
    # first to arms strictly inside their bounds (an arm on a bound stays exactly on it);
    # the others only when that leaves more than ulps (no arm inside, or too little room)
    inside = [k for k in range(n) if lo[k] < p[k] < hi[k]]
    others = [k for k in range(n) if k not in inside]
    for order, tol in ((inside, 0.0), (others, 1e-12), (inside, 0.0)):
        for _ in range(3):
            r = 1.0 - math.fsum(p)
            if abs(r) <= tol:
                break
            for k in order:
                if abs(r) <= tol:
                    break
                if r > 0.0 and p[k] < hi[k]:
                    p[k] = min(hi[k], p[k] + min(r, hi[k] - p[k]))
                elif r < 0.0 and p[k] > lo[k]:
                    p[k] = max(lo[k], p[k] - min(-r, p[k] - lo[k]))
                else:
                    continue
                r = 1.0 - math.fsum(p)
    return p


# ---- the bandit --------------------------------------------------------------------


def _stats_fresh() -> dict[str, Any]:
    return {"pulls": 0, "updates": 0, "ema_reward": 0.0, "ema_loss": None, "last_reward": None}


class BanditMixture:
    """A bandit over data sources under a :class:`MixturePolicy` (see the module doc).

    ``generator`` is the only source of randomness: one ``generator.random()``
    per :meth:`choose`. Register it with :class:`~ripresa.core.rng.RandomStreams`;
    :meth:`state_dict` does not hold its state.

    ``phase`` counts pivots: a pivot starts a fresh bandit
    (:meth:`new_phase`) whose ``phase`` is one more. ``steps_in_phase`` counts
    the :meth:`update` calls (training steps with an observed loss) since the
    phase began.
    """

    def __init__(
        self,
        arms: Sequence[str],
        policy: MixturePolicy | None = None,
        generator: np.random.Generator | None = None,
        *,
        reward_ema: float = 0.9,
        temperature: float = 0.1,
        exploration: float = 0.1,
        phase: int = 0,
    ) -> None:
        if isinstance(arms, str) or not isinstance(arms, Sequence) or not arms:
            raise BadInput(
                "a mixture needs a non-empty list of arms (data sources)",
                expected="a list of names",
                found=repr(arms),
            )
        names = [_arm_name(a, "arm") for a in arms]
        dup = sorted({a for a in names if names.count(a) > 1})
        if dup:
            raise BadInput("arms are not unique", expected="distinct names", found=dup)
        policy = MixturePolicy() if policy is None else policy
        if not isinstance(policy, MixturePolicy):
            raise BadInput("policy must be a MixturePolicy", found=type(policy).__name__)
        if not isinstance(generator, np.random.Generator):
            raise BadInput(
                "a mixture draws with a numpy Generator",
                expected="numpy.random.Generator (e.g. np.random.default_rng(seed))",
                found=type(generator).__name__,
                hint="register the same generator with RandomStreams so it is saved",
            )
        self.arms: tuple[str, ...] = tuple(sorted(names))
        policy.validate(self.arms)
        self.policy = policy
        self.generator = generator
        self.reward_ema, self.temperature, self.exploration = _check_hyper(
            reward_ema, temperature, exploration
        )
        self.phase = _count(phase, "phase")
        self.steps_in_phase = 0
        self.total_pulls = 0
        self._stats: dict[str, dict[str, Any]] = {a: _stats_fresh() for a in self.arms}
        self._lo, self._hi = policy.bounds(self.arms)
        #: zombie arms dropped by the last :meth:`load_state_dict`: ``{"arm", "pulls", "ema_reward"}``
        self.dropped_arms: list[dict[str, Any]] = []
        #: current arms the last loaded state did not know (they started fresh)
        self.added_arms: list[str] = []

    # -- hyper-parameters --------------------------------------------------------
    @property
    def hyper(self) -> dict[str, float]:
        return {
            "reward_ema": self.reward_ema,
            "temperature": self.temperature,
            "exploration": self.exploration,
        }

    def new_phase(self, policy: MixturePolicy | None = None) -> BanditMixture:
        """A fresh bandit for the next phase (a pivot): same arms, generator and
        hyper-parameters, ``phase + 1``, no learned statistics, ``policy`` if given."""
        return BanditMixture(
            self.arms,
            self.policy if policy is None else policy,
            self.generator,
            phase=self.phase + 1,
            **self.hyper,
        )

    # -- the policy ----------------------------------------------------------------
    def preferences(self) -> dict[str, float]:
        """What the bandit would play without the policy: softmax + exploration."""
        rewards = [self._stats[a]["ema_reward"] / self.temperature for a in self.arms]
        top = max(rewards)
        e = [math.exp(r - top) for r in rewards]
        z = math.fsum(e)
        k = len(self.arms)
        eps = self.exploration
        return {a: (1.0 - eps) * (x / z) + eps / k for a, x in zip(self.arms, e, strict=True)}

    def probabilities(self) -> dict[str, float]:
        """The draw probabilities: :meth:`preferences` projected onto the policy box."""
        q = self.preferences()
        p = project_to_box([q[a] for a in self.arms], self._lo, self._hi)
        return dict(zip(self.arms, p, strict=True))

    def choose(self) -> str:
        """Draw the arm of the next batch (exactly one ``generator.random()``)."""
        p = self.probabilities()
        u = float(self.generator.random())
        cum = 0.0
        chosen = None
        for a in self.arms:
            cum += p[a]
            if u < cum:
                chosen = a
                break
        if chosen is None:  # u beyond the rounded total: the last arm that can be drawn
            chosen = [a for a in self.arms if p[a] > 0.0][-1]
        self._stats[chosen]["pulls"] += 1
        self.total_pulls += 1
        return chosen

    def update(self, arm: str, loss: float) -> float:
        """Report the loss of a batch drawn from ``arm``; return its reward.

        The reward is the drop of the arm's loss below its moving average
        (0 at the first observation). A non-finite loss is refused and leaves
        the state untouched.
        """
        if arm not in self._stats:
            raise BadInput(
                f"update for arm {arm!r}, which is not a data source of this mixture",
                expected=f"one of {list(self.arms)}",
                found=repr(arm),
            )
        try:
            value = float(loss)
        except (TypeError, ValueError):
            raise BadInput(
                f"loss of arm {arm!r} is not a number", expected="a finite float", found=repr(loss)
            ) from None
        if not math.isfinite(value):
            raise BadInput(
                f"loss of arm {arm!r} is not finite",
                expected="a finite float",
                found=repr(value),
                hint="the mixture state was not changed; skip this update (and check the "
                "training step that produced it)",
            )
        s = self._stats[arm]
        beta = self.reward_ema
        reward = 0.0 if s["ema_loss"] is None else s["ema_loss"] - value
        if not math.isfinite(reward):
            raise BadInput(
                f"reward of arm {arm!r} overflows",
                expected="a finite loss drop",
                found=f"{s['ema_loss']!r} - {value!r}",
                hint="the mixture state was not changed",
            )
        ema_loss = value if s["ema_loss"] is None else beta * s["ema_loss"] + (1.0 - beta) * value
        ema_reward = beta * s["ema_reward"] + (1.0 - beta) * reward
        if not (math.isfinite(ema_loss) and math.isfinite(ema_reward / self.temperature)):
            raise BadInput(
                f"loss of arm {arm!r} is out of range for the mixture's averages",
                expected="a loss of ordinary magnitude",
                found=repr(value),
                hint="the mixture state was not changed",
            )
        s["ema_loss"], s["ema_reward"], s["last_reward"] = ema_loss, ema_reward, reward
        s["updates"] += 1
        self.steps_in_phase += 1
        return reward

    # -- observation -------------------------------------------------------------
    def pulls(self) -> dict[str, int]:
        return {a: self._stats[a]["pulls"] for a in self.arms}

    def shares(self) -> dict[str, float]:
        """Observed share of draws per arm (all 0.0 before the first draw)."""
        n = self.total_pulls
        return {a: (self._stats[a]["pulls"] / n if n else 0.0) for a in self.arms}

    def stats(self) -> dict[str, dict[str, Any]]:
        """A copy of the per-arm statistics."""
        return {a: dict(self._stats[a]) for a in self.arms}

    # -- save / restore ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON primitives: arms, per-arm statistics, policy, counters, hyper-parameters.

        The generator's state is not here (see the class doc).
        """
        return {
            "kind": STATE_KIND,
            "version": STATE_VERSION,
            "arms": list(self.arms),
            "stats": {a: dict(self._stats[a]) for a in self.arms},
            "policy": self.policy.to_dict(),
            "phase": self.phase,
            "steps_in_phase": self.steps_in_phase,
            "total_pulls": self.total_pulls,
            "hyper": self.hyper,
        }

    def load_state_dict(
        self,
        state: Mapping[str, Any],
        *,
        allow_policy_change: bool = False,
        source: str | Path | None = None,
    ) -> None:
        """Restore a :meth:`state_dict` exactly (floats bit for bit).

        * Malformed state → :class:`~ripresa.errors.SchemaError`.
        * Other floors/caps for a current arm, or other hyper-parameters →
          :class:`PolicyChanged` unless ``allow_policy_change`` (then the
          current policy and hyper-parameters are kept). Bounds that the saved
          policy gave only to dropped arms do not count.
        * Saved arms that are not current arms (zombies) are dropped with a
          :class:`ZombieArmWarning` and listed in :attr:`dropped_arms`; current
          arms unknown to the state start fresh and are listed in :attr:`added_arms`.

        Nothing is changed when an error is raised.
        """
        parsed = _parse_state(state, source)
        saved_policy: MixturePolicy = parsed["policy"]
        if not allow_policy_change:
            if not saved_policy.same_bounds(self.policy, self.arms):
                changed = [
                    f"{a}: [{saved_policy.floor(a):g}, {saved_policy.cap(a):g}] -> "
                    f"[{self.policy.floor(a):g}, {self.policy.cap(a):g}]"
                    for a in self.arms
                    if saved_policy.bounds([a]) != self.policy.bounds([a])
                ]
                raise PolicyChanged(
                    "the saved mixture state was learned under other caps/floors",
                    file=source,
                    expected=f"policy {self.policy.to_dict()}",
                    found=f"policy {saved_policy.to_dict()} ({'; '.join(changed)})",
                    hint=_PIVOT_HINT,
                )
            if parsed["hyper"] != self.hyper:
                raise PolicyChanged(
                    "the saved mixture state was learned with other hyper-parameters",
                    file=source,
                    expected=self.hyper,
                    found=parsed["hyper"],
                    hint=_PIVOT_HINT,
                )
        stats: dict[str, dict[str, Any]] = parsed["stats"]
        zombies = [a for a in parsed["arms"] if a not in self._stats]
        dropped = [
            {"arm": a, "pulls": stats[a]["pulls"], "ema_reward": stats[a]["ema_reward"]}
            for a in zombies
        ]
        added = [a for a in self.arms if a not in stats]
        # commit
        self._stats = {a: dict(stats[a]) if a in stats else _stats_fresh() for a in self.arms}
        self.total_pulls = sum(s["pulls"] for s in self._stats.values())
        self.phase = parsed["phase"]
        self.steps_in_phase = parsed["steps_in_phase"]
        self.dropped_arms = dropped
        self.added_arms = added
        if dropped:
            names = ", ".join(
                f"{d['arm']!r} (pulls {d['pulls']}, ema_reward {d['ema_reward']!r})"
                for d in dropped
            )
            where = f" in {source}" if source is not None else ""
            warnings.warn(
                f"mixture state{where} names arms that are no longer data sources; "
                f"dropped, not carried into the run: {names}",
                ZombieArmWarning,
                stacklevel=2,
            )


# ---- state parsing ------------------------------------------------------------------


def _count(
    value: object,
    what: str,
    *,
    source: str | Path | None = None,
    err: type[RipresaError] = BadInput,
) -> int:
    if isinstance(value, bool):
        raise err(
            f"{what} must be an integer, not a bool",
            file=source,
            expected="int >= 0",
            found=repr(value),
        )
    try:
        n = operator.index(value)
    except TypeError:
        raise err(
            f"{what} must be an integer", file=source, expected="int >= 0", found=repr(value)
        ) from None
    if n < 0:
        raise err(f"{what} must not be negative", file=source, expected="int >= 0", found=n)
    return int(n)


def _check_hyper(
    reward_ema: object, temperature: object, exploration: object
) -> tuple[float, float, float]:
    def num(v: object, what: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise BadInput(f"{what} must be a number", found=repr(v))
        if isinstance(v, np.integer | np.floating):
            v = v.item()
        return float(checked_number(v, file=None, field=what, lo=-sys.float_info.max, hi=sys.float_info.max,
                                    integer=False, error=BadInput))

    b, t, e = (
        num(reward_ema, "reward_ema"),
        num(temperature, "temperature"),
        num(exploration, "exploration"),
    )
    if not 0.0 <= b < 1.0:
        raise BadInput("reward_ema must be in [0, 1)", expected="0 <= reward_ema < 1", found=b)
    if not t > 0.0:
        raise BadInput("temperature must be positive", expected="temperature > 0", found=t)
    if not 0.0 <= e <= 1.0:
        raise BadInput("exploration must be in [0, 1]", expected="0 <= exploration <= 1", found=e)
    return b, t, e


def _schema(message: str, source: str | Path | None, **kw: Any) -> SchemaError:
    kw.setdefault(
        "hint",
        "the mixture state is damaged or was not written by ripresa; "
        "archive it and start a fresh bandit",
    )
    return SchemaError(message, file=source, **kw)


def _float(
    value: object, what: str, source: str | Path | None, *, allow_none: bool = False
) -> float | None:
    if value is None and allow_none:
        return None
    try:  # the one checked conversion (docs/FAULTS.md, "Numbers read from files")
        return checked_number(value, file=source, field=what, lo=-sys.float_info.max, hi=sys.float_info.max,
                              integer=False, error=SchemaError)
    except SchemaError as exc:
        raise _schema(f"{what} must be a finite number", source, expected="a finite float", found=exc.found) from None


def _parse_state(state: object, source: str | Path | None) -> dict[str, Any]:
    """Check every field of a saved state; return clean values (nothing mutated)."""
    if not isinstance(state, Mapping):
        raise _schema(
            "mixture state must be an object", source, expected="dict", found=type(state).__name__
        )
    keys = {
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
    missing = sorted(keys - set(state))
    if missing:
        raise _schema(
            "mixture state lacks keys", source, expected=sorted(keys), found=f"missing {missing}"
        )
    if state["kind"] != STATE_KIND or state["version"] != STATE_VERSION:
        raise _schema(
            "not a mixture state of a known version",
            source,
            expected=f"kind {STATE_KIND!r} version {STATE_VERSION}",
            found=f"kind {state['kind']!r} version {state['version']!r}",
        )
    arms = state["arms"]
    if (
        not isinstance(arms, list)
        or not all(isinstance(a, str) and a for a in arms)
        or len(set(arms)) != len(arms)
    ):
        raise _schema(
            "mixture state 'arms' must be a list of distinct names", source, found=repr(arms)
        )
    raw_stats = state["stats"]
    if not isinstance(raw_stats, Mapping) or set(raw_stats) != set(arms):
        raise _schema(
            "mixture state 'stats' must have one entry per arm",
            source,
            expected=sorted(arms),
            found=sorted(raw_stats) if isinstance(raw_stats, Mapping) else type(raw_stats).__name__,
        )
    stats: dict[str, dict[str, Any]] = {}
    fields = {"pulls", "updates", "ema_reward", "ema_loss", "last_reward"}
    for a in arms:
        s = raw_stats[a]
        if not isinstance(s, Mapping) or set(s) != fields:
            raise _schema(
                f"statistics of arm {a!r} are malformed",
                source,
                expected=sorted(fields),
                found=sorted(s) if isinstance(s, Mapping) else type(s).__name__,
            )
        stats[a] = {
            "pulls": _count(s["pulls"], f"pulls of arm {a!r}", source=source, err=SchemaError),
            "updates": _count(
                s["updates"], f"updates of arm {a!r}", source=source, err=SchemaError
            ),
            "ema_reward": _float(s["ema_reward"], f"ema_reward of arm {a!r}", source),
            "ema_loss": _float(s["ema_loss"], f"ema_loss of arm {a!r}", source, allow_none=True),
            "last_reward": _float(
                s["last_reward"], f"last_reward of arm {a!r}", source, allow_none=True
            ),
        }
    total = _count(state["total_pulls"], "total_pulls", source=source, err=SchemaError)
    if total != sum(s["pulls"] for s in stats.values()):
        raise _schema(
            "mixture state 'total_pulls' disagrees with the arms' pulls",
            source,
            expected=sum(s["pulls"] for s in stats.values()),
            found=total,
        )
    try:
        policy = MixturePolicy.from_dict(state["policy"], source)
    except BadInput as e:
        raise _schema(
            f"mixture state 'policy' is invalid: {e.message}", source, found=e.found
        ) from None
    hyper = state["hyper"]
    names = {"reward_ema", "temperature", "exploration"}
    if not isinstance(hyper, Mapping) or set(hyper) != names:
        raise _schema(
            "mixture state 'hyper' is malformed", source, expected=sorted(names), found=repr(hyper)
        )
    return {
        "arms": arms,
        "stats": stats,
        "policy": policy,
        "phase": _count(state["phase"], "phase", source=source, err=SchemaError),
        "steps_in_phase": _count(
            state["steps_in_phase"], "steps_in_phase", source=source, err=SchemaError
        ),
        "hyper": {k: _float(hyper[k], f"hyper-parameter {k}", source) for k in sorted(names)},
    }
