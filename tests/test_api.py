"""The public API: the exact names of ``ripresa.__all__``, the exception tree, the
deprecated root names, and a core that never imports the engine's matplotlib."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import ripresa
from ripresa import errors

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}

# the order of ripresa.__all__: version, state, samplers, session, checkpoint.pt, store, verify, errors
PUBLIC = ("__version__ TrainingState Stateful Progress ScriptState RandomStreams EpochSampler DistributedEpochSampler StatefulLoader make_exact "
          "Checkpointer save_checkpoint load_checkpoint CheckpointStore verify_resume Trajectory "
          "RipresaError IntegrityError BadInput SaveFailed").split()


def test_all_is_exactly_the_public_api():
    assert ripresa.__all__ == PUBLIC


@pytest.mark.parametrize("name", PUBLIC)
def test_each_public_name_imports_without_a_warning(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        value = getattr(ripresa, name)
    assert value is not None
    if name != "__version__":
        assert value.__name__ == name


@pytest.mark.slow
def test_star_import_gives_the_public_api_only():
    code = "from ripresa import *\nnames = sorted(k for k in dir() if not k.startswith('__'))\nprint(names)\n"
    res = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(sorted(n for n in PUBLIC if n != "__version__"))


def test_a_dropped_root_name_resolves_with_a_deprecation_warning_naming_its_module():
    from ripresa.store.retention import KeepLast

    with pytest.warns(DeprecationWarning, match=r"ripresa\.store\.retention"):
        assert ripresa.KeepLast is KeepLast
    assert "KeepLast" not in ripresa.__all__ and "KeepLast" not in dir(ripresa)
    with pytest.raises(AttributeError):
        ripresa.VerificationFailed  # noqa: B018 - removed: it was never raised
    with pytest.raises(AttributeError):
        ripresa.no_such_name  # noqa: B018


def test_the_exception_tree_has_three_families():
    for family, code in ((errors.IntegrityError, 1), (errors.BadInput, 2), (errors.SaveFailed, 2)):
        assert family.__bases__ == (errors.RipresaError,)
        assert family.exit_code == code
    # a disk failure is not bad input: `except BadInput` does not swallow it
    assert not issubclass(errors.SaveFailed, errors.BadInput)
    assert not issubclass(errors.BadInput, errors.IntegrityError)
    for sub in (errors.SchemaError, errors.CheckFailed):
        assert issubclass(sub, errors.IntegrityError) and sub.exit_code == 1
    for sub in (errors.OutputExists, errors.MissingDependency, errors.LockHeld):
        assert issubclass(sub, errors.BadInput) and sub.exit_code == 2
    # an intact checkpoint of other versions/code/data: refused (exit 1), never skipped as damaged
    assert issubclass(errors.IdentityMismatch, errors.BadInput) and errors.IdentityMismatch.exit_code == 1
    assert not issubclass(errors.IdentityMismatch, errors.IntegrityError)
    assert not hasattr(errors, "VerificationFailed")


@pytest.mark.slow
def test_the_core_never_imports_matplotlib():
    """`import ripresa; ripresa.Checkpointer` and the library layers work without the engine extra."""
    code = (
        "import sys, ripresa\n"
        "ripresa.Checkpointer, ripresa.CheckpointStore, ripresa.verify_resume, ripresa.load_checkpoint\n"
        "import ripresa.cli, ripresa.tools.inspect, ripresa.tools.export, ripresa.tools.convert\n"
        "import ripresa.session.distributed, ripresa.store.async_save, ripresa.formats.dcp\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_misuse_of_the_python_api_raises_type_or_value_error(tmp_path):
    import numpy as np
    import torch

    model = torch.nn.Linear(2, 1)
    state = ripresa.TrainingState(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    for kwargs, exc in (({"every": -1}, ValueError), ({"every": 1.5}, TypeError), ({"every": True}, TypeError),
                        ({"max_failed_saves": 0}, ValueError)):
        with pytest.raises(exc):
            ripresa.Checkpointer(tmp_path / "run", state, handle_signals=False, **kwargs)
    with pytest.raises(TypeError, match="TrainingState"):
        ripresa.Checkpointer(tmp_path / "run", {"model": model}, handle_signals=False)
    assert not (tmp_path / "run").exists()  # refused before the folder was created or locked
    with pytest.raises(TypeError, match="nn.Module"):
        ripresa.TrainingState(model={"w": torch.zeros(2)})
    with pytest.raises(TypeError, match="RandomStreams"):
        ripresa.TrainingState(model=model, rng=np.random.default_rng(0))
    with pytest.raises(TypeError, match="state_dict"):
        ripresa.TrainingState(model=model, data=[1, 2, 3])
    with pytest.raises(ValueError):
        ripresa.EpochSampler(0, 4, seed=0)
    with pytest.raises(TypeError):
        ripresa.RandomStreams(numpy={"data": "not a generator"})


@pytest.mark.slow
def test_a_plot_without_matplotlib_is_a_missing_dependency_naming_the_engine_extra(tmp_path):
    """`sys.modules["matplotlib"] = None` makes every matplotlib import fail, as on a core-only install."""
    run = tmp_path / "run"
    run.mkdir()
    (run / ".loss.jsonl").write_text("".join(f'{{"step":{s},"loss":{3.0 - s / 10}}}\n' for s in range(1, 6)))
    code = ("import sys\nsys.modules['matplotlib'] = None\nfrom ripresa.cli import main\n"
            f"sys.exit(main(['plot', {str(run)!r}]))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "drawing a plot needs matplotlib" in res.stderr
    assert "pip install 'ripresa[engine]'" in res.stderr
    assert "Traceback" not in res.stderr and not (run / "plot.png").exists()
