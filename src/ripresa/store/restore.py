"""Restoring a saved state into the live :class:`~ripresa.core.state.TrainingState` (every storage backend).

A backend reads a generation into a :class:`Loaded` (everything checked,
nothing live changed yet); :func:`restore_loaded` then restores it: the whole
state at once (:meth:`TrainingState.restore`) when the saved state holds the
model and optimizer and the model is not sharded, or else the rest first
checked (:func:`validate_rest`), the weights loaded by the backend, and the
rest restored with the random streams last (:func:`restore_rest`). In a
distributed run each rank takes its own view (:func:`rank_view`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.numbers import checked_number
from ..core.schema import check_distributed_record
from ..core.state import Progress, RestorePlan, TrainingState
from ..errors import IntegrityError


@dataclass
class Loaded:
    """A generation read and checked, before anything live changes.

    ``saved``: the saved state (with ``model``/``optimizer`` when ``whole``);
    ``load_weights(model, optimizer, saved, sharded)``: puts model and
    optimizer in place when the state is not restored whole.
    """

    saved: dict[str, Any]
    whole: bool
    load_weights: Callable[[torch.nn.Module, Any, Mapping[str, Any], bool], None]
    file: Path | None = None
    #: The load ran :func:`~ripresa.core.schema.validate_saved_state` on ``saved`` (when it declares a format).
    validated: bool = False


@dataclass
class Restored:
    """What a restore did: the progress, the saved ``extra``, whether this rank's streams stayed fresh."""

    progress: Progress
    extra: dict[str, Any]
    fresh: bool = False
    event: dict[str, Any] = field(default_factory=dict)


def restore_loaded(state: TrainingState, loaded: Loaded, *, restore_rng: bool, allow: Mapping[str, bool],
                   rank: int | None = None, sharded: bool = False) -> Restored:
    """Restore ``loaded`` into ``state`` (``rank``: this rank's view of a distributed save)."""
    saved, fresh = loaded.saved, False
    if rank is not None:
        saved, fresh, _world = rank_view(saved, rank)
    else:
        saved_record(saved, loaded.file)
    rng = restore_rng and not fresh
    # The structure was checked where the state was read, unless this is a rank's view (other entries swapped in).
    read = loaded.validated and rank is None and isinstance(saved, dict) and "format" in saved
    if loaded.whole and not sharded:
        progress = (state.restore_read if read else state.restore)(saved, restore_rng=rng, **allow)
    else:
        plan = validate_rest(state, saved, allow)
        loaded.load_weights(state.model, state.optimizer, saved, sharded)
        progress = restore_rest(state, saved, rng, allow, plan if read else None)
    return Restored(progress, saved.get("extra") or {}, fresh)


def rank_view(full: Mapping[str, Any], rank: int) -> tuple[dict[str, Any], bool, int]:
    """This rank's view of a saved state: ``(state, fresh, saved world size)``.

    The companion's top-level random streams, data position and objects are
    rank 0's; ``extra.distributed.ranks[r]`` holds rank ``r``'s. A rank the
    saved run did not have keeps rank 0's data position and objects and is
    ``fresh``: its random streams are not restored.
    """
    out = dict(full)
    rec = saved_record(full, None)
    saved_world = checked_number(rec["world_size"], file=None, field="world_size", lo=1, hi=2**20) if rec else 1
    if rank >= saved_world:
        return out, True, saved_world
    if rec:
        entry = rec["ranks"][rank]
        if checked_number(entry["rank"], file=None, field="ranks[].rank", lo=0, hi=2**20) != rank:
            raise IntegrityError("per-rank entries are out of order in the companion", expected=rank, found=entry["rank"])
        out["rng"], out["data"], out["objects"] = entry["rng"], entry["data"], entry["objects"]
    return out, False, saved_world


def saved_record(full: Mapping[str, Any], file: Any) -> dict[str, Any] | None:
    """``extra.distributed`` of a saved state, validated (counts against the list it holds) before any use."""
    extra = full.get("extra")
    if extra is None:
        return None
    if not isinstance(extra, Mapping):
        raise IntegrityError("the saved state's 'extra' is not a dict", file=file, found=type(extra).__name__)
    return check_distributed_record(extra.get("distributed"), file=file)


def rest_proxy(state: TrainingState) -> TrainingState:
    """The state without model and optimizer (restored by DCP or set_state_dict), sharing every other object."""
    proxy = copy.copy(state)
    proxy.model = torch.nn.Module()
    proxy.optimizer = None
    return proxy


def _strip(rest: Mapping[str, Any]) -> dict[str, Any]:
    r = dict(rest)
    r["model"] = {}
    r["optimizer"] = None
    return r


def validate_rest(state: TrainingState, rest: Mapping[str, Any], allow: Mapping[str, bool]) -> RestorePlan:
    """Refuse, before anything is changed, what :meth:`TrainingState.restore` would refuse (the structure was
    checked where the state was read); return what the restore records."""
    return rest_proxy(state).check_restore(
        _strip(rest), structure_checked=True, allow_version_change=allow.get("allow_version_change", False),
        allow_code_change=allow.get("allow_code_change", False), allow_data_change=allow.get("allow_data_change", False),
        allow_config_change=allow.get("allow_config_change"))


def restore_rest(state: TrainingState, rest: Mapping[str, Any], restore_rng: bool, allow: Mapping[str, bool],
                 plan: RestorePlan | None = None) -> Progress:
    """Scheduler, scaler, data, objects, then the random streams last (model and optimizer are loaded).

    With ``plan`` (what :func:`validate_rest` accepted of a state checked where it was read) nothing is checked
    again; without, :meth:`TrainingState.restore` checks everything once more (a rank's view).
    """
    proxy = rest_proxy(state)
    if plan is not None:
        progress = proxy.restore_checked(_strip(rest), plan, restore_rng=restore_rng)
    else:
        progress = proxy.restore(_strip(rest), restore_rng=restore_rng, **allow)
    state.lineage = proxy.lineage
    state.accepted_config_changes = proxy.accepted_config_changes
    return progress
