"""Capture and restore of every random generator a run draws from.

States are stored as ``weights_only``-safe primitives: ints, floats, strings,
lists and uint8 tensors — never numpy arrays — so that a checkpoint loads with
``torch.load(..., weights_only=True)``.

Re-seeding is not restoring: :meth:`RandomStreams.restore` puts each generator
back in the exact state it had at the save, so the next draw is the draw the
uninterrupted run would have made.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .errors import SchemaError

#: Keys of the global generators, always captured.
PYTHON = "python"
NUMPY_LEGACY = "numpy_legacy"
TORCH_CPU = "torch_cpu"
TORCH_CUDA = "torch_cuda"


def _python_state(r: random.Random | None = None) -> dict[str, Any]:
    version, internal, gauss_next = (r.getstate() if r is not None else random.getstate())
    return {"version": int(version), "state": [int(x) for x in internal], "gauss_next": gauss_next}


def _set_python_state(state: Mapping[str, Any], r: random.Random | None = None) -> None:
    value = (int(state["version"]), tuple(int(x) for x in state["state"]), state["gauss_next"])
    (r.setstate if r is not None else random.setstate)(value)


def _numpy_bitgen_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """numpy bit-generator state dict → primitives (arrays become lists of ints)."""

    def conv(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return {"__ndarray__": str(v.dtype), "data": [int(x) for x in v.ravel()]}
        if isinstance(v, Mapping):
            return {str(k): conv(x) for k, x in v.items()}
        if isinstance(v, np.integer):
            return int(v)
        if isinstance(v, np.floating):
            return float(v)
        return v

    return conv(state)


def _numpy_bitgen_state_back(state: Mapping[str, Any]) -> dict[str, Any]:
    def conv(v: Any) -> Any:
        if isinstance(v, Mapping) and "__ndarray__" in v:
            return np.asarray(v["data"], dtype=np.dtype(v["__ndarray__"]))
        if isinstance(v, Mapping):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(state)


def _numpy_legacy_state() -> dict[str, Any]:
    return _numpy_bitgen_state(np.random.get_state(legacy=False))


def _set_numpy_legacy_state(state: Mapping[str, Any]) -> None:
    np.random.set_state(_numpy_bitgen_state_back(state))


class RandomStreams:
    """The random generators of a run: the global ones plus those you register.

    Always captured: Python ``random``, NumPy's legacy global state, torch CPU,
    and torch CUDA per device when CUDA is available. Register your own
    ``numpy.random.Generator``, ``torch.Generator`` and ``random.Random``
    objects by name::

        streams = RandomStreams(numpy={"data": np_gen}, torch={"aug": g})
    """

    def __init__(
        self,
        *,
        numpy: Mapping[str, np.random.Generator] | None = None,
        torch_generators: Mapping[str, torch.Generator] | None = None,
        python: Mapping[str, random.Random] | None = None,
    ) -> None:
        self.numpy = dict(numpy or {})
        self.torch_generators = dict(torch_generators or {})
        self.python = dict(python or {})
        for name, g in self.numpy.items():
            if not isinstance(g, np.random.Generator):
                raise TypeError(f"numpy generator {name!r} must be a numpy.random.Generator, got {type(g).__name__}")
        for name, g in self.torch_generators.items():
            if not isinstance(g, torch.Generator):
                raise TypeError(f"torch generator {name!r} must be a torch.Generator, got {type(g).__name__}")

    # -- capture ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The current state of every stream, as ``weights_only``-safe primitives."""
        out: dict[str, Any] = {
            PYTHON: _python_state(),
            NUMPY_LEGACY: _numpy_legacy_state(),
            TORCH_CPU: torch.get_rng_state().clone(),
            TORCH_CUDA: [s.clone() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else None,
            "numpy": {n: _numpy_bitgen_state(g.bit_generator.state) for n, g in self.numpy.items()},
            "torch": {n: g.get_state().clone() for n, g in self.torch_generators.items()},
            "python_random": {n: _python_state(r) for n, r in self.python.items()},
        }
        return out

    # -- restore ---------------------------------------------------------------
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put every stream back in the captured state. Names must match exactly.

        Call this *last* in a restore, immediately before the next step: any
        construction after it that draws random numbers would shift the streams.
        """
        self.check_compatible(state)
        _set_python_state(state[PYTHON])
        _set_numpy_legacy_state(state[NUMPY_LEGACY])
        torch.set_rng_state(state[TORCH_CPU])
        cuda = state.get(TORCH_CUDA)
        if cuda is not None:
            if not torch.cuda.is_available():
                raise SchemaError(
                    "checkpoint holds CUDA generator states but CUDA is not available",
                    expected="a CUDA device",
                    found="CPU only",
                    hint="resume on a machine with the same number of CUDA devices",
                )
            if len(cuda) != torch.cuda.device_count():
                raise SchemaError(
                    "CUDA generator states do not match the device count",
                    expected=f"{len(cuda)} devices",
                    found=f"{torch.cuda.device_count()} devices",
                )
            torch.cuda.set_rng_state_all(cuda)
        for n, g in self.numpy.items():
            g.bit_generator.state = _numpy_bitgen_state_back(state["numpy"][n])
        for n, g in self.torch_generators.items():
            g.set_state(state["torch"][n])
        for n, r in self.python.items():
            _set_python_state(state["python_random"][n], r)

    def check_compatible(self, state: Mapping[str, Any]) -> None:
        """Raise :class:`SchemaError` unless ``state`` has exactly our streams."""
        for key in (PYTHON, NUMPY_LEGACY, TORCH_CPU, "numpy", "torch", "python_random"):
            if key not in state:
                raise SchemaError(
                    f"random state lacks '{key}'",
                    expected="every generator of the run",
                    found=sorted(state),
                    hint="the checkpoint is incomplete; it was not written by this version of the trainer",
                )
        for kind, mine in (("numpy", self.numpy), ("torch", self.torch_generators), ("python_random", self.python)):
            saved = set(state[kind])
            if saved != set(mine):
                raise SchemaError(
                    f"registered {kind} generators differ from the checkpoint's",
                    expected=sorted(saved),
                    found=sorted(mine),
                    hint="register the same named generators as the run that saved",
                )
        t = state[TORCH_CPU]
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8):
            raise SchemaError("torch CPU generator state is not a uint8 tensor", found=type(t).__name__)

    # -- observation -------------------------------------------------------------
    def peek(self) -> dict[str, float]:
        """The next draw of every stream, observed and then undone.

        Used by the verifier: two runs at the same point must agree on these.
        The streams are left exactly as they were.
        """
        saved = self.state_dict()
        draws: dict[str, float] = {
            PYTHON: random.random(),
            NUMPY_LEGACY: float(np.random.random()),
            TORCH_CPU: float(torch.rand(1, dtype=torch.float64).item()),
        }
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                draws[f"{TORCH_CUDA}:{i}"] = float(torch.rand(1, device=f"cuda:{i}", dtype=torch.float64).item())
        for n, g in self.numpy.items():
            draws[f"numpy:{n}"] = float(g.random())
        for n, g in self.torch_generators.items():
            draws[f"torch:{n}"] = float(torch.rand(1, generator=g, dtype=torch.float64, device=g.device).item())
        for n, r in self.python.items():
            draws[f"python_random:{n}"] = r.random()
        self.load_state_dict(saved)
        return draws
