"""Training memory: where it goes (the ledger) and how mixed precision gets it down (the levers).

Owns the ledger of a training step (:mod:`.ledger`), counted without arithmetic on fake tensors
(:mod:`.fake`), and memory-lean mixed precision (:mod:`.lean`): low-precision saves for float32 ops
(:mod:`.saves`), GELUs written out in Python run as one fused op (:mod:`.activations`), activations'
outputs recomputed from their inputs for the ops that save them (:mod:`.activation_outputs`), their
inputs from the up-projection's input (:mod:`.activation_inputs`), one copy of an activation autocast
casts for several linears (:mod:`.shared_casts`), dropouts' masks kept as bits (:mod:`.dropout_masks`),
the first three through saved tensors substituted
(:mod:`.substitutes`; standing aside for others' hooks: :mod:`.hooks_around`), the LM head's
lazy logits (:mod:`.chunked_loss`) and its loss fused a block of rows at a time with the gradients made
in the forward (:mod:`.fused_loss`), low-precision weights with float32
masters (:mod:`.master`), transformer blocks' cheap ops recomputed in backward (:mod:`.recompute`),
torchao's per-parameter compiled step with its compile wrapper built once (:mod:`.compile_once`), and
an AdamW that rounds bfloat16 parameters stochastically in a few multi-tensor ops (:mod:`.sr_adamw`).

May import: :mod:`amp_backends.precision`, :mod:`amp_backends.backend`, :mod:`amp_backends.registry`,
:mod:`amp_backends.eager`, :mod:`amp_backends.errors`, :mod:`amp_backends.patches`,
:mod:`amp_backends.torch_private` and torch.
"""

from __future__ import annotations

from .activation_inputs import ActivationInputs, UpProjectionEdited, recompute_activation_inputs
from .activation_outputs import ActivationOutputs, recompute_activation_outputs
from .activations import FusedActivations, fused_activations
from .chunked_loss import LazyHeadError, LazyLogits, head_lever_refusal, lazy_head
from .compile_once import compile_once
from .dropout_masks import DropoutMasks, pack_dropout_masks
from .fused_loss import linear_cross_entropy
from .lean import Lean, LeanError, memory_lean
from .ledger import PARTS, Ledger, MemoryReport
from .master import MasterWeights
from .recompute import Recompute, RecomputeError, selective_recompute
from .saves import low_precision_saves
from .shared_casts import SharedCasts, share_casts
from .sr_adamw import StochasticAdamW

__all__ = ["PARTS", "ActivationInputs", "ActivationOutputs", "DropoutMasks", "FusedActivations", "LazyHeadError", "LazyLogits", "Lean",
           "LeanError", "Ledger", "MasterWeights", "MemoryReport", "Recompute", "RecomputeError", "SharedCasts",
           "StochasticAdamW", "UpProjectionEdited", "compile_once", "fused_activations", "head_lever_refusal", "lazy_head",
           "linear_cross_entropy", "low_precision_saves", "memory_lean", "pack_dropout_masks", "recompute_activation_inputs",
           "recompute_activation_outputs", "selective_recompute", "share_casts"]
