"""Checkpoint-free resharding of a CONA training state between parallel strategies.

Entry point: :func:`switch_strategy` (see :mod:`megatron_cona.reshard.switch`)."""

from megatron_cona.reshard.plan import ReshardPlan, ReshardPlanError, SegmentMeta, build_plan
from megatron_cona.reshard.switch import DEFAULT_BUCKET_BYTES, SwitchResult, switch_strategy

__all__ = ["DEFAULT_BUCKET_BYTES", "ReshardPlan", "ReshardPlanError", "SegmentMeta",
           "SwitchResult", "build_plan", "switch_strategy"]
