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

from ..errors import SchemaError

#: Keys of the global generators, always captured.
PYTHON = "python"
NUMPY_LEGACY = "numpy_legacy"
TORCH_CPU = "torch_cpu"
TORCH_CUDA = "torch_cuda"


def _python_state(r: random.Random | None = None) -> dict[str, Any]:
    version, internal, gauss_next = (r.getstate() if r is not None else random.getstate())
    return {"version": int(version), "state": [int(x) for x in internal], "gauss_next": gauss_next}


def _set_python_state(state: Mapping[str, Any], r: random.Random | None = None) -> None:
    value = validate_python_state(state, PYTHON)
    (r.setstate if r is not None else random.setstate)(value)


def numpy_bitgen_state(state: Mapping[str, Any]) -> dict[str, Any]:
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


#: numpy bit generators a state may name (each validated by loading it into a fresh instance).
_BIT_GENERATORS = ("MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64")
#: dtypes of the arrays inside numpy bit-generator states.
_NDARRAY_DTYPES = {"uint32": (0, 2**32 - 1), "uint64": (0, 2**64 - 1)}
#: Python's Mersenne Twister: 624 words plus the position.
_PY_MT_WORDS = 625


def numpy_bitgen_state_back(state: Mapping[str, Any], where: str = "rng") -> dict[str, Any]:
    """Primitives → numpy bit-generator state dict; every array checked before it is built."""

    def conv(v: Any, path: str, depth: int) -> Any:
        if depth > 8:
            raise SchemaError(f"{path}: nested too deeply for a bit-generator state")
        if isinstance(v, Mapping) and "__ndarray__" in v:
            dtype, data = v.get("__ndarray__"), v.get("data")
            if dtype not in _NDARRAY_DTYPES or not isinstance(data, list) or len(data) > 1 << 16:
                raise SchemaError(f"{path}: malformed array in a numpy bit-generator state",
                                  expected=f"dtype in {sorted(_NDARRAY_DTYPES)}, a list of at most 65536 ints",
                                  found=f"dtype {str(dtype)[:40]}, {type(data).__name__}")
            lo, hi = _NDARRAY_DTYPES[dtype]
            if not all(type(x) is int and lo <= x <= hi for x in data):
                raise SchemaError(f"{path}: array values out of range for {dtype}")
            return np.asarray(data, dtype=np.dtype(dtype))
        if isinstance(v, Mapping):
            return {k: conv(x, f"{path}.{k}", depth + 1) for k, x in v.items()}
        return v

    if not isinstance(state, Mapping):
        raise SchemaError(f"{where}: numpy bit-generator state is not a dict", found=type(state).__name__)
    return conv(state, where, 0)


def validate_numpy_state(state: Any, where: str = "rng", *, bit_generator: str | None = None) -> dict[str, Any]:
    """Check a saved numpy bit-generator state by loading it into a fresh generator; return it as numpy wants it.

    The generator named by the state must be one of numpy's (MT19937 keys must
    hold 624 words, PCG64 states two 128-bit ints, ...): numpy's own setter
    checks each field, on a throw-away instance. Raises :class:`SchemaError`.
    """
    back = numpy_bitgen_state_back(state, where)
    name = back.get("bit_generator")
    if name not in _BIT_GENERATORS or (bit_generator is not None and name != bit_generator):
        raise SchemaError(f"{where}: unknown numpy bit generator", expected=bit_generator or list(_BIT_GENERATORS),
                          found=repr(name)[:80])
    if name == "MT19937":
        key = (back.get("state") or {}).get("key") if isinstance(back.get("state"), dict) else None
        if not isinstance(key, np.ndarray) or key.shape != (624,):
            raise SchemaError(f"{where}: MT19937 key must hold 624 words",
                              found=None if key is None else f"shape {getattr(key, 'shape', type(key).__name__)}")
    try:
        getattr(np.random, name)().state = back
        if name == "MT19937" and set(back) >= {"has_gauss", "gauss"}:
            np.random.RandomState().set_state(back)  # the legacy global state: gauss fields too
    except (ValueError, TypeError, KeyError, OverflowError, AttributeError) as exc:
        raise SchemaError(f"{where}: numpy {name} state is malformed", found=f"{type(exc).__name__}: {str(exc)[:160]}",
                          hint="the companion was edited or not written by ripresa") from exc
    return back


def validate_python_state(state: Any, where: str = "rng") -> tuple[int, tuple[int, ...], Any]:
    """Check a saved ``random.Random`` state (625 32-bit words, gauss_next) on a fresh instance; return it."""
    if not isinstance(state, Mapping) or set(state) != {"version", "state", "gauss_next"}:
        raise SchemaError(f"{where}: Python random state is malformed", expected="{version, state, gauss_next}",
                          found=sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__)
    words, version, gauss = state["state"], state["version"], state["gauss_next"]
    if (type(version) is not int or not isinstance(words, list) or len(words) != _PY_MT_WORDS
            or not all(type(x) is int and 0 <= x < 2**32 for x in words)
            or not (gauss is None or type(gauss) is float)):
        raise SchemaError(f"{where}: Python random state is malformed",
                          expected=f"an int version, {_PY_MT_WORDS} words < 2**32, gauss_next float or null",
                          found=f"{len(words) if isinstance(words, list) else type(words).__name__} words")
    value = (version, tuple(words), gauss)
    try:
        random.Random().setstate(value)
    except (ValueError, TypeError, OverflowError) as exc:
        raise SchemaError(f"{where}: Python random state is refused by random.setstate",
                          found=f"{type(exc).__name__}: {str(exc)[:160]}") from exc
    return value


def validate_torch_state(state: Any, where: str = "rng", *, device: str = "cpu") -> torch.Tensor:
    """Check a saved torch generator byte state: uint8, 1-D, the exact length, accepted by a fresh generator."""
    expected = torch.Generator().get_state().numel() if device == "cpu" else None  # an accelerator's: its own size
    if (not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1
            or (state.numel() != expected if expected is not None else not 0 < state.numel() <= 1 << 20)):
        found = (f"{state.dtype}, shape {tuple(state.shape)}" if isinstance(state, torch.Tensor) else type(state).__name__)
        raise SchemaError(f"{where}: torch {device} generator state is malformed",
                          expected=f"a 1-D uint8 tensor of {expected or 'at most 1 MiB of'} bytes", found=found)
    if device == "cpu":
        try:
            torch.Generator().set_state(state)
        except RuntimeError as exc:
            raise SchemaError(f"{where}: torch generator state is refused by torch",
                              found=str(exc)[:160]) from exc
    return state


def validate_rng_state(state: Any, where: str = "rng") -> None:
    """Structural check of a saved :meth:`RandomStreams.state_dict` (from a file): every stream well formed.

    The one check that ``ripresa inspect --deep`` and a resume share
    (docs/VERIFY.md): each stream's state has its exact size and is accepted by
    a throw-away generator of its kind. Names are checked against the live
    streams later, by :meth:`RandomStreams.check_compatible`. Raises
    :class:`SchemaError` only.
    """
    if not isinstance(state, Mapping):
        raise SchemaError(f"{where} is not a dict", found=type(state).__name__)
    for key in (PYTHON, NUMPY_LEGACY, TORCH_CPU, "numpy", "torch", "python_random"):
        if key not in state:
            raise SchemaError(f"{where} lacks '{key}'", expected="every generator of the run", found=sorted(map(str, state)))
    validate_python_state(state[PYTHON], f"{where}.{PYTHON}")
    validate_numpy_state(state[NUMPY_LEGACY], f"{where}.{NUMPY_LEGACY}", bit_generator="MT19937")
    validate_torch_state(state[TORCH_CPU], f"{where}.{TORCH_CPU}")
    cuda = state.get(TORCH_CUDA)
    if cuda is not None:
        if not isinstance(cuda, list) or len(cuda) > 4096:
            raise SchemaError(f"{where}.{TORCH_CUDA} is not a list of device states", found=type(cuda).__name__)
        for i, t in enumerate(cuda):
            validate_torch_state(t, f"{where}.{TORCH_CUDA}[{i}]", device="cuda")
    for kind in ("numpy", "torch", "python_random"):
        if not isinstance(state[kind], Mapping) or not all(isinstance(k, str) for k in state[kind]):
            raise SchemaError(f"{where}.{kind} is not a dict of named generators", found=type(state[kind]).__name__)
    for n, v in state["numpy"].items():
        validate_numpy_state(v, f"{where}.numpy.{n}")
    for n, v in state["torch"].items():
        dev = "cpu" if isinstance(v, torch.Tensor) and v.numel() != 16 else "cuda"
        validate_torch_state(v, f"{where}.torch.{n}", device=dev)
    for n, v in state["python_random"].items():
        validate_python_state(v, f"{where}.python_random.{n}")


def _numpy_legacy_state() -> dict[str, Any]:
    return numpy_bitgen_state(np.random.get_state(legacy=False))


def _set_numpy_legacy_state(state: Mapping[str, Any]) -> None:
    np.random.set_state(validate_numpy_state(state, NUMPY_LEGACY, bit_generator="MT19937"))


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
            "numpy": {n: numpy_bitgen_state(g.bit_generator.state) for n, g in self.numpy.items()},
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
        validate_rng_state(state)  # everything checked before any generator is changed
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
            g.bit_generator.state = validate_numpy_state(state["numpy"][n], f"numpy.{n}",
                                                         bit_generator=type(g.bit_generator).__name__)
        for n, g in self.torch_generators.items():
            validate_torch_state(state["torch"][n], f"torch.{n}", device=g.device.type)
            g.set_state(state["torch"][n])
        for n, r in self.python.items():
            _set_python_state(state["python_random"][n], r)

    def check_compatible(self, state: Mapping[str, Any]) -> None:
        """Raise :class:`SchemaError` unless ``state`` has exactly our streams."""
        if not isinstance(state, Mapping):
            raise SchemaError("random state is not a dict", found=type(state).__name__)
        for key in (PYTHON, NUMPY_LEGACY, TORCH_CPU, "numpy", "torch", "python_random"):
            if key not in state:
                raise SchemaError(
                    f"random state lacks '{key}'",
                    expected="every generator of the run",
                    found=sorted(state),
                    hint="the checkpoint is incomplete; it was not written by this version of the trainer",
                )
        for kind, mine in (("numpy", self.numpy), ("torch", self.torch_generators), ("python_random", self.python)):
            if not isinstance(state[kind], Mapping):
                raise SchemaError(f"random state '{kind}' is not a dict", found=type(state[kind]).__name__)
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
