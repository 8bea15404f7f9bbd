"""Distributed training helpers: the process group a backend's device needs.

Owns :func:`init_process_group` and :func:`destroy_process_group` (:mod:`.process_group`).

May import: :mod:`amp_backends.backend`, :mod:`amp_backends.registry`, :mod:`amp_backends.devices`,
:mod:`amp_backends.errors`.
"""

from __future__ import annotations

from .process_group import DistInfo, destroy_process_group, init_process_group

__all__ = ["DistInfo", "destroy_process_group", "init_process_group"]
