"""The layer rule (docs/ARCHITECTURE.md): each layer of src/ripresa imports only the layers below it.

The contract is ``[tool.importlinter]`` in pyproject.toml; this runs it, as ``make lint`` does.
"""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_layer_contract_is_kept():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    assert Path(exe).exists(), "import-linter is not installed: pip install -e '.[dev]'"
    res = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " kept, 0 broken" in res.stdout
    # inside store/: the registry over the kinds over the run folder and the commit protocol (no circle)
    assert "store: mirror > registry > kinds > run folder and commit protocol KEPT" in res.stdout
