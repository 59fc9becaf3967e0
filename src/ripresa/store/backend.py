"""Storage backends: the protocol every kind of generation implements, and the registry of kinds.

The public face of :mod:`ripresa.store.base` (the :class:`StorageBackend` protocol and
:class:`BackendBase`), the kinds (:mod:`ripresa.store.bin`, :mod:`ripresa.store.general`,
:mod:`ripresa.store.dcp`) and their registry (:mod:`ripresa.store.kinds`): docs/ARCHITECTURE.md,
"Storage backends". A new kind of generation is one module and one :func:`register_backend` line.
"""

from __future__ import annotations

from ..formats.generation import Check, Generation
from .base import BackendBase, StorageBackend, load_full_into
from .bin import BinBackend, ForeignCheckpointWarning
from .dcp import DcpBackend
from .general import GeneralBackend
from .kinds import (
    AUTO,
    MODES,
    BackendSpec,
    Owner,
    backend_of,
    backends_for,
    check_generation_file,
    choose_writer,
    describe,
    formats,
    generation_files,
    kinds,
    latest_valid_any,
    latest_valid_of,
    newest_kind,
    owner_of,
    register_backend,
    registered,
    retain,
    spec_of,
    unregister_backend,
)

__all__ = ["AUTO", "MODES", "BackendBase", "BackendSpec", "BinBackend", "Check", "DcpBackend", "ForeignCheckpointWarning",
           "GeneralBackend", "Generation", "Owner", "StorageBackend", "backend_of", "backends_for", "check_generation_file",
           "choose_writer", "describe", "formats", "generation_files", "kinds", "latest_valid_any", "latest_valid_of", "load_full_into", "newest_kind",
           "owner_of", "register_backend", "registered", "retain", "spec_of", "unregister_backend"]
