"""The variables of a training script saved with the run: :class:`ScriptState` (docs/API.md, "State in script
variables"; docs/FORMAT.md, "Script variables")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import SchemaError


def _script_value_error(value: Any, where: str, depth: int = 0) -> str | None:
    """Why ``value`` cannot be a saved script variable (None when it can)."""
    if depth > 16:
        return f"{where}: nested more than 16 levels deep"
    if value is None or isinstance(value, bool | int | float | str | torch.Tensor):
        return None
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            bad = _script_value_error(v, f"{where}[{i}]", depth + 1)
            if bad:
                return bad
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str) or (k.startswith("__") and k.endswith("__")):
                return f"{where}: key {k!r} (keys are strings, not __dunder__)"
            bad = _script_value_error(v, f"{where}[{k!r}]", depth + 1)
            if bad:
                return bad
        return None
    hint = " (convert it: int(x), float(x), x.item(), torch.as_tensor(x))" if type(value).__module__ == "numpy" else ""
    return f"{where}: a {type(value).__name__}{hint}"


def _tensor_devices(value: Any, out: list[str]) -> list[str]:
    """The devices of the tensors in ``value``, in traversal order."""
    if isinstance(value, torch.Tensor):
        out.append(str(value.device))
    elif isinstance(value, list | tuple):
        for v in value:
            _tensor_devices(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensor_devices(v, out)
    return out


def _to_devices(value: Any, devices: list[str]) -> Any:
    """``value`` with each tensor moved to the next device of ``devices`` (the CPU where that one is absent)."""
    if isinstance(value, torch.Tensor):
        dev = torch.device(devices.pop(0)) if devices else torch.device("cpu")
        if dev.type == "cuda" and not torch.cuda.is_available():
            dev = torch.device("cpu")
        return value.to(dev)
    if isinstance(value, tuple):
        return tuple(_to_devices(v, devices) for v in value)
    if isinstance(value, list):
        return [_to_devices(v, devices) for v in value]
    if isinstance(value, dict):
        return {k: _to_devices(v, devices) for k, v in value.items()}
    return value


class ScriptState:
    """The variables of a training script that the next steps depend on, saved with the run.

    A loop keeps state outside the model and optimizer: a batch prefetched
    before the optimizer step, a running-average loss, an early-stopping
    counter, the best validation loss. Declare them once, with their initial
    values, and register the holder as a user object::

        vars = ScriptState(batch=None, ema_loss=0.0, bad_evals=0, best_val=float("inf"))
        state = TrainingState(model=model, optimizer=opt, objects={"script": vars})

    then read and write them as attributes (``vars.batch = get_batch()``) or
    items (``vars["batch"]``). A value is ``None``, a ``bool``/``int``/
    ``float``/``str`` (restored exactly: same type, same bits), a tensor
    (saved as a tensor — dtype, shape and bits; a general generation keeps it
    in its tensor file — and put back on the device it was on, or the CPU when
    that device is absent), or a list, tuple or str-keyed dict of these.

    The names are fixed at construction: assigning an undeclared name is an
    ``AttributeError`` (a typo would otherwise be silently left out of every
    checkpoint), and a checkpoint whose names differ is refused at the resume
    (docs/FORMAT.md, "Script variables"). docs/API.md, "State in script
    variables", gives the rule for where ``resume()`` goes.
    """

    __slots__ = ("_values",)

    def __init__(self, **values: Any) -> None:
        for name, value in values.items():
            bad = _script_value_error(value, name)
            if bad:
                raise TypeError(f"script variable {bad} cannot be saved; use None, bool, int, float, str, a tensor, "
                                "or a list/tuple/str-keyed dict of these")
        object.__setattr__(self, "_values", dict(values))

    # --------------------------------------------------------------- access
    def __getattr__(self, name: str) -> Any:
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(f"ScriptState has no variable {name!r} (declared: {sorted(self._values)})") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_values":  # copy.copy / deepcopy / pickle restoring the slot
            object.__setattr__(self, name, value)
            return
        self[name] = value

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __setitem__(self, name: str, value: Any) -> None:
        if name not in self._values:
            raise AttributeError(f"ScriptState has no variable {name!r}: declare it with its initial value, "
                                 f"ScriptState(..., {name}=...), so that every checkpoint carries it")
        bad = _script_value_error(value, name)
        if bad:
            raise TypeError(f"script variable {bad} cannot be saved; use None, bool, int, float, str, a tensor, "
                            "or a list/tuple/str-keyed dict of these")
        self._values[name] = value

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Any:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def keys(self) -> Any:
        return self._values.keys()

    def update(self, **values: Any) -> None:
        """Set several declared variables at once (``sv.update(batch=(X, Y), best_val=best_val)``)."""
        for name, value in values.items():
            self[name] = value

    def items(self) -> Any:
        return self._values.items()

    def __repr__(self) -> str:
        return "ScriptState(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    # --------------------------------------------------------------- Stateful
    def state_dict(self) -> dict[str, Any]:
        """``{"values": name -> value, "devices": name -> [device of each tensor]}`` (tensors as they are)."""
        for name, value in self._values.items():  # a list or dict may have been changed in place
            bad = _script_value_error(value, name)
            if bad:
                raise TypeError(f"script variable {bad} cannot be saved")
        return {"values": dict(self._values),
                "devices": {k: _tensor_devices(v, []) for k, v in self._values.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Put the saved values back (checked whole before any is changed)."""
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"values", "devices"}:
            raise SchemaError("script state is malformed", expected='{"values": ..., "devices": ...}',
                              found=sorted(map(str, state_dict)) if isinstance(state_dict, Mapping) else type(state_dict).__name__)
        values, devices = state_dict["values"], state_dict["devices"]
        if not isinstance(values, Mapping) or not isinstance(devices, Mapping):
            raise SchemaError("script state is malformed", expected="two dicts", found=type(values).__name__)
        if set(values) != set(self._values):
            raise SchemaError("the script variables differ from the checkpoint's",
                              expected=sorted(map(str, values)), found=sorted(self._values),
                              hint="declare the same ScriptState variables as the run that saved; "
                                   "missing or unused state is an error, never silently defaulted")
        for name, value in values.items():
            bad = _script_value_error(value, name)
            devs = devices.get(name)
            if bad or not isinstance(devs, list) or not all(isinstance(d, str) for d in devs):
                raise SchemaError("a saved script variable is malformed", found=bad or f"{name}: devices {devs!r}")
        restored = {name: _to_devices(value, list(devices[name])) for name, value in values.items()}
        self._values.update({name: restored[name] for name in self._values})
