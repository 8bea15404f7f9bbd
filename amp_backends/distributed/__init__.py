"""Distributed training helpers: the process group a backend's device needs, and what travels on it.

Owns :func:`init_process_group` and :func:`destroy_process_group` (:mod:`.process_group`); what a
process group's collective library takes (:mod:`.library`); DDP gradients reduced in float16 or
bfloat16 (:func:`reduce_in_low_precision`, :mod:`.compression`); payload bytes of each collective,
counted as dispatched (:func:`count_collectives`, :mod:`.counting`); FSDP2's MixedPrecisionPolicy from the
backend and the precision policy, gradients divided, then summed (:func:`shard_in_low_precision`, :mod:`.sharding`).

May import: :mod:`amp_backends.backend`, :mod:`amp_backends.registry`, :mod:`amp_backends.devices`,
:mod:`amp_backends.errors`, :mod:`amp_backends.torch_private` and torch.
"""

from __future__ import annotations

from .compression import LowPrecisionReduce, reduce_in_low_precision
from .counting import CollectiveLog, count_collectives
from .library import CollectiveError, library_of
from .process_group import DistInfo, destroy_process_group, init_process_group
from .sharding import ShardPlan, shard_in_low_precision

__all__ = ["CollectiveError", "CollectiveLog", "DistInfo", "LowPrecisionReduce", "count_collectives",
           "destroy_process_group", "init_process_group", "library_of", "reduce_in_low_precision",
           "ShardPlan", "shard_in_low_precision"]
