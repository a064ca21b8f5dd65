"""Checkpoint-free resharding: move weights and optimizer state between two built model/optimizer
sets of different parallel layouts, in memory, over the job's process group.

Entry point: :func:`transfer_state`. It does not import the CONA runtime; the runtime's
transactional switch (:func:`megatron_cona.runtime.switch.switch_strategy`) builds the new set,
calls it and commits or rolls back."""

from megatron_cona.reshard.plan import ReshardPlan, ReshardPlanError, SegmentMeta, build_plan
from megatron_cona.reshard.state import ModelOptimizerSet
from megatron_cona.reshard.transfer import DEFAULT_BUCKET_BYTES, TransferStats, transfer_state

__all__ = ["DEFAULT_BUCKET_BYTES", "ModelOptimizerSet", "ReshardPlan", "ReshardPlanError",
           "SegmentMeta", "TransferStats", "build_plan", "transfer_state"]
