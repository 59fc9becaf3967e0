"""``ripresa export --inference`` of a run whose model is a Hugging Face ``transformers`` model.

When the run's config records the model (``ExactResume``'s ``"transformers"``
entry), the inference export of a general generation is a folder that
``AutoModel...from_pretrained(folder)`` loads without ripresa: ``config.json``
from the record and ``model.safetensors`` with a tied weight written once, as
``save_pretrained`` does. Nothing recorded is executed: the record is JSON,
checked for its shape (docs/INTEGRATIONS_transformers.md, "Export for from_pretrained").
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import SchemaError

#: The key of the run config under which the integration records the model.
SECTION = "transformers"
_CLASS = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def transformers_record(config: Any, where: Any = None) -> dict[str, Any] | None:
    """``{"model_class", "model_config"}`` recorded by the integration, None when the run has none; checked."""
    if not isinstance(config, dict) or SECTION not in config:
        return None
    rec = config[SECTION]
    cls = rec.get("model_class") if isinstance(rec, dict) else None
    cfg = rec.get("model_config") if isinstance(rec, dict) else None
    if not isinstance(cls, str) or not _CLASS.fullmatch(cls) or not isinstance(cfg, dict):
        raise SchemaError("the run's transformers record is malformed", file=where,
                          expected='{"model_class": a class name, "model_config": a dict}',
                          found=repr(rec)[:120], hint="it is written by ripresa.integrations.transformers.ExactResume")
    return {"model_class": cls, "model_config": cfg}


def hf_config(record: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of the folder: the recorded config, ``architectures`` naming the class."""
    cfg = dict(record["model_config"])
    cfg["architectures"] = [record["model_class"]]
    return cfg


def drop_tied(tensors: dict[str, Any], tied: dict[str, str]) -> dict[str, Any]:
    """The tensors as ``save_pretrained`` writes them: each tied weight once, under its first name."""
    return {k: v for k, v in tensors.items() if k not in tied}


README = """\
# A ripresa inference export of a transformers model ({cls}), step {step}

The model's weights at step {step} of `{run}`, as `save_pretrained` writes
them: `config.json` and `model.safetensors` ({n} tensors; tied weights once:
{tied}). No ripresa is needed to load it:

```python
from transformers import AutoModel, {cls}
model = {cls}.from_pretrained("THIS_FOLDER")   # or AutoModel...from_pretrained
```

The weights are bitwise those of the checkpoint. NOT a resume checkpoint: no
optimizer state, random streams or data position.
"""
