"""The mirror: a run's committed generations copied to a second store, and a resume from it (docs/MIRROR.md).

This package's front door holds the names the other layers use (the session, the engine, the CLI, the tests);
nothing outside it imports its modules. What each module holds (docs/ARCHITECTURE.md, "Storage backends"):

- :mod:`~ripresa.store.mirror.contract`: what a mirror does, in one :class:`MirrorContract`;
- :mod:`~ripresa.store.mirror.commands`: ``ripresa mirror status|push|pull``, :func:`prefetch` and
  :func:`pull_generation` (the tools that read a store: ``ripresa inspect URL``, ``export URL``);
- :mod:`~ripresa.store.mirror.upload`: the upload thread (:class:`Mirror`, :func:`open_mirror`);
- :mod:`~ripresa.store.mirror.pull`: the pull and the restore of the run's own files;
- :mod:`~ripresa.store.mirror.plan`: the one upload plan of ``status``, ``push`` and the thread;
- :mod:`~ripresa.store.mirror.target`: which store may be a mirror, and ``mirror.json``;
- :mod:`~ripresa.store.mirror.layout`: what a mirror holds (object names, the run manifest).

The files of a generation are its kind's to name (:func:`ripresa.store.kinds.generation_files`): no module
here knows a kind's files.
"""

from __future__ import annotations

from .commands import (
    cli_pull,
    cli_push,
    cli_status,
    prefetch,
    pull_generation,
    push_policy,
    resolve_url,
    status,
)
from .contract import MirrorContract
from .layout import (
    CONFIG_SIG,
    DEFAULT_CLOSE_TIMEOUT,
    MIRROR_MARKER,
    MIRROR_RECORD,
    RUN_MANIFEST,
    MirrorSpec,
    RemoteView,
    RunManifest,
    local_generations,
    main_of,
)
from .plan import UploadPlan, plan_upload
from .pull import has_local_generation, pull_config, pull_run, restore_run, retrying
from .target import MirrorTarget, claim_target, record_url, recorded, redacting
from .upload import Mirror, open_mirror

__all__ = ["CONFIG_SIG", "DEFAULT_CLOSE_TIMEOUT", "MIRROR_MARKER", "MIRROR_RECORD", "RUN_MANIFEST", "Mirror",
           "MirrorContract", "MirrorSpec", "MirrorTarget", "RemoteView", "RunManifest", "UploadPlan", "claim_target",
           "cli_pull", "cli_push", "cli_status", "has_local_generation", "local_generations", "main_of", "open_mirror",
           "plan_upload", "prefetch", "pull_config", "pull_generation", "pull_run", "push_policy", "record_url", "recorded",
           "redacting", "resolve_url", "restore_run", "retrying", "status"]
