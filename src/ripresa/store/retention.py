"""Retention: which saved generations to keep — pure policies over step numbers (docs/RETENTION.md).

A policy never touches the disk: it says which of the steps holding a *valid* generation it keeps
(:class:`KeepLast`, :class:`KeepEvery`, :class:`KeepSteps`, :class:`KeepBest` by a recorded metric,
:class:`KeepAny` their union), and :func:`plan_deletions` turns that into the steps to delete, never
the newest valid one nor a protected one. :func:`parse_retention` reads the one-line text form
(``last=3,every=1000``; :attr:`RetentionPolicy.spec` writes it). Misuse of the Python API raises
``TypeError``/``ValueError``; only text from a user raises :class:`~ripresa.errors.BadInput`.
The run folder applies the plan after a durable commit (:meth:`ripresa.store.folder.RunFolder.retain`).
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..core.args import check_int
from ..errors import BadInput

__all__ = [
    "DEFAULT_RETENTION",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepSteps",
    "RetentionPolicy",
    "parse_retention",
    "plan_deletions",
]

_SPEC_GRAMMAR = ("comma-separated terms: last=N, every=K, steps=S1+S2+..., best=METRIC[:K[:min|max]] "
                 "(N, K >= 1; steps >= 0)")
_SPEC_EXAMPLE = "e.g. 'last=3', 'last=3,every=1000', 'last=2,steps=500+1200' or 'last=1,best=val_loss:2:min'"
#: What a metric policy is told: the metric values recorded with each step's generation.
StepMetrics = Mapping[int, Mapping[str, float]]


def _as_step(value: object, what: str) -> int:
    """``value`` as a non-negative int step; bools and non-integers are refused (``TypeError``)."""
    return check_int(value, what, at_least=0)


def _as_steps(steps: Iterable[object], what: str) -> set[int]:
    return {_as_step(s, what) for s in steps}


def _set_count(policy: Any, name: str, hint: str) -> None:
    """Validate a frozen policy's count field ``name`` (an int >= 1) and store the int."""
    object.__setattr__(policy, name, check_int(getattr(policy, name), f"{type(policy).__name__}.{name}", at_least=1, hint=hint))


class RetentionPolicy(ABC):
    """A pure rule that picks, from a list of steps, the ones to keep."""

    @abstractmethod
    def keep(self, steps: Sequence[int]) -> set[int]:
        """The subset of ``steps`` this policy keeps (order and duplicates ignored)."""

    @property
    @abstractmethod
    def spec(self) -> str:
        """The one-line text form, readable back by :func:`parse_retention`."""

    def keep_scored(self, steps: Sequence[int], metrics: StepMetrics) -> set[int]:
        """The subset of ``steps`` kept, knowing the metrics recorded with each step.

        ``metrics`` maps a step to the values its generation was saved with
        (a step may be missing, or lack a name). Step-only policies ignore it.
        """
        return self.keep(steps)

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The metrics this policy reads (the ``Checkpointer`` records them with each generation)."""
        return ()

    def __or__(self, other: RetentionPolicy) -> KeepAny:
        """``a | b`` keeps a step if ``a`` or ``b`` keeps it."""
        if not isinstance(other, RetentionPolicy):
            return NotImplemented
        return KeepAny((self, other))

    def __str__(self) -> str:
        return self.spec


class _OneCount(RetentionPolicy):
    """A policy of one count field (``field``), validated at construction, written ``word=N``."""

    field: ClassVar[str]
    word: ClassVar[str]
    hint: ClassVar[str]

    def __post_init__(self) -> None:
        _set_count(self, self.field, self.hint)

    @property
    def spec(self) -> str:
        return f"{self.word}={getattr(self, self.field)}"


@dataclass(frozen=True)
class KeepLast(_OneCount):
    """Keep the ``n`` newest steps (``n >= 1``)."""

    n: int
    field: ClassVar[str] = "n"
    word: ClassVar[str] = "last"
    hint: ClassVar[str] = "keep at least the newest step: KeepLast(1)"

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(sorted(_as_steps(steps, "step"))[-self.n :])


@dataclass(frozen=True)
class KeepEvery(_OneCount):
    """Keep every step divisible by ``k`` (``k >= 1``; step 0 counts as divisible)."""

    k: int
    field: ClassVar[str] = "k"
    word: ClassVar[str] = "every"
    hint: ClassVar[str] = "KeepEvery(1) keeps every step"

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in _as_steps(steps, "step") if s % self.k == 0}


@dataclass(frozen=True)
class KeepSteps(RetentionPolicy):
    """Keep named "major" steps (a non-empty set of steps >= 0).

    Any iterable of ints is accepted and stored as a ``frozenset``. A named
    step that has no generation is simply not in the answer.
    """

    steps: frozenset[int]

    def __post_init__(self) -> None:
        if isinstance(self.steps, str | bytes) or not isinstance(self.steps, Iterable):
            raise TypeError(f"KeepSteps.steps must be a collection of int steps >= 0, not {self.steps!r:.80} "
                            "(e.g. KeepSteps({500, 1200}))")
        steps = frozenset(_as_steps(self.steps, "KeepSteps step"))
        if not steps:
            raise ValueError("KeepSteps needs at least one step (leave the policy out instead of naming no step)")
        object.__setattr__(self, "steps", steps)

    def keep(self, steps: Sequence[int]) -> set[int]:
        return _as_steps(steps, "step") & self.steps

    @property
    def spec(self) -> str:
        return "steps=" + "+".join(str(s) for s in sorted(self.steps))


@dataclass(frozen=True)
class KeepAny(RetentionPolicy):
    """Union of policies: a step is kept if any of ``policies`` keeps it.

    Nested unions are flattened, so ``(a | b) | c == KeepAny((a, b, c))``.
    """

    policies: tuple[RetentionPolicy, ...]

    def __post_init__(self) -> None:
        if isinstance(self.policies, RetentionPolicy) or not isinstance(self.policies, Iterable):
            raise TypeError(f"KeepAny.policies must be a tuple of retention policies, not {self.policies!r:.80} "
                            "(e.g. KeepAny((KeepLast(3), KeepEvery(1000))) or KeepLast(3) | KeepEvery(1000))")
        flat: list[RetentionPolicy] = []
        for p in self.policies:
            if isinstance(p, KeepAny):
                flat.extend(p.policies)
            elif isinstance(p, RetentionPolicy):
                flat.append(p)
            else:
                raise TypeError(f"KeepAny.policies holds {p!r:.80}, not a retention policy "
                                "(KeepLast, KeepEvery, KeepSteps, KeepBest or KeepAny)")
        if not flat:
            raise ValueError(f"KeepAny needs at least one policy (the default is {DEFAULT_RETENTION.spec!r})")
        object.__setattr__(self, "policies", tuple(flat))

    def keep(self, steps: Sequence[int]) -> set[int]:
        return self.keep_scored(steps, {})

    def keep_scored(self, steps: Sequence[int], metrics: StepMetrics) -> set[int]:
        clean = sorted(_as_steps(steps, "step"))
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep_scored(clean, metrics)
        return kept

    @property
    def metric_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n for p in self.policies for n in p.metric_names))

    @property
    def spec(self) -> str:
        return ",".join(p.spec for p in self.policies)


_METRIC_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")


@dataclass(frozen=True)
class KeepBest(RetentionPolicy):
    """Keep the ``k`` best steps by ``metric``: the lowest (``mode="min"``) or highest (``"max"``) values.

    The value of a step is the one recorded with its generation: the latest
    ``metric`` the loop reported through ``step_done(step, **metrics)`` at or
    before that step (docs/RETENTION.md). A step without a finite value (never
    reported, NaN, inf) is not kept by this policy; ties keep the older step
    (a later step must be strictly better to displace it, as Lightning's
    ``save_top_k``). Alone it keeps nothing but the best: combine it with
    :class:`KeepLast` (``KeepLast(1) | KeepBest("val_loss", k=2)``) to keep
    fallbacks; the newest generation is kept for resume whatever the policy.
    """

    metric: str
    k: int = 1
    mode: str = "min"

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not _METRIC_RE.match(self.metric):
            raise TypeError(f"KeepBest.metric must be a metric name such as 'val_loss', not {self.metric!r:.80}")
        _set_count(self, "k", "KeepBest(metric, k=1) keeps the single best")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest.mode must be 'min' or 'max', not {self.mode!r:.40}")

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set()  # no metric known: nothing is best (the newest is kept by plan_deletions)

    def keep_scored(self, steps: Sequence[int], metrics: StepMetrics) -> set[int]:
        scored = []
        for s in _as_steps(steps, "step"):
            value = (metrics.get(s) or {}).get(self.metric)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                scored.append(((value if self.mode == "min" else -value), s))
        return {s for _, s in sorted(scored)[: self.k]}

    @property
    def metric_names(self) -> tuple[str, ...]:
        return (self.metric,)

    @property
    def spec(self) -> str:
        return f"best={self.metric}:{self.k}:{self.mode}"


#: Keep the three newest generations: one to resume from, two to fall back on
#: if the newest turns out unreadable.
DEFAULT_RETENTION: RetentionPolicy = KeepLast(3)


def plan_deletions(
    steps: Iterable[int],
    policy: RetentionPolicy,
    *,
    newest_valid: int | None,
    protected: Iterable[int] = (),
    metrics: StepMetrics | None = None,
) -> list[int]:
    """The steps whose generations may be deleted, sorted ascending.

    ``steps`` are the steps that have a valid generation; invalid or unknown
    generations are simply left out by the caller (this function never deletes
    what it is not shown). A step is deleted when ``policy`` does not keep it,
    except:

    * ``newest_valid`` — the generation a resume would use — is never deleted,
      whatever the policy says; nor is the largest of ``steps`` (the two are
      the same for a well-formed call; keeping both errs on the safe side);
    * ``protected`` steps (a generation being written, one a fork reads) are
      never deleted.

    ``metrics`` are the values recorded with each step's generation, for a
    metric policy (:class:`KeepBest`); without them such a policy keeps nothing
    beyond what the guarantees keep.

    Applying the result and calling again with the remaining steps deletes
    nothing more.
    """
    valid = _as_steps(steps, "step")
    keep_always = _as_steps(protected, "protected step")
    if newest_valid is not None:
        keep_always.add(_as_step(newest_valid, "newest_valid"))
    if valid:
        keep_always.add(max(valid))
    kept = policy.keep_scored(sorted(valid), metrics or {})
    return sorted(valid - kept - keep_always)


_TERM_RE = re.compile(r"^\s*(?P<key>[A-Za-z_]+)\s*=\s*(?P<value>.*?)\s*$")
_INT_RE = re.compile(r"^[0-9]+$")


def parse_retention(spec: str, *, source: str | Path | None = None) -> RetentionPolicy:
    """Read a retention spec such as ``"last=3,every=1000,steps=500+1200"``.

    Terms are comma-separated and combined by union (a repeated key adds one
    more policy). One term gives that policy itself; several give a
    :class:`KeepAny`. ``source`` names where the spec came from (a config file,
    a command-line option) for the error message. Raises :class:`BadInput`
    (exit 2) on a bad spec: the text comes from a user, not from code.
    """

    def bad(message: str, found: object) -> BadInput:
        return BadInput(
            message, file=source, expected=_SPEC_GRAMMAR, found=found, hint=_SPEC_EXAMPLE
        )

    if not isinstance(spec, str):
        raise bad("a retention spec must be text", repr(spec))
    if not spec.strip():
        raise bad("the retention spec is empty", repr(spec))

    def number(term: str, text: str, *, at_least: int) -> int:
        if not _INT_RE.match(text):
            raise bad(f"in retention term {term!r}: {text!r} is not a whole number", repr(spec))
        n = int(text)
        if n < at_least:
            raise bad(f"in retention term {term!r}: {n} is below {at_least}", repr(spec))
        return n

    policies: list[RetentionPolicy] = []
    for raw in spec.split(","):
        term = raw.strip()
        m = _TERM_RE.match(raw)
        if not term or m is None:
            raise bad(f"retention term {term!r} is not of the form key=value", repr(spec))
        key, value = m["key"].lower(), m["value"]
        try:
            if key == "last":
                policies.append(KeepLast(number(term, value, at_least=1)))
            elif key == "every":
                policies.append(KeepEvery(number(term, value, at_least=1)))
            elif key == "best":
                name, _, more = value.partition(":")
                k_text, _, mode = more.partition(":")
                k = number(term, k_text.strip(), at_least=1) if k_text.strip() else 1
                mode = mode.strip().lower() or "min"
                if mode not in ("min", "max"):
                    raise bad(f"in retention term {term!r}: the mode is 'min' or 'max', not {mode!r}", repr(spec))
                policies.append(KeepBest(name.strip(), k, mode))
            elif key == "steps":
                parts = value.split("+")
                policies.append(KeepSteps(frozenset(number(term, p.strip(), at_least=0) for p in parts)))
            else:
                raise bad(f"unknown retention key {key!r} in term {term!r}", repr(spec))
        except (TypeError, ValueError) as exc:  # a policy refused what the grammar let through
            raise bad(f"in retention term {term!r}: {exc}", repr(spec)) from exc
    return policies[0] if len(policies) == 1 else KeepAny(tuple(policies))
