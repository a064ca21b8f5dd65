"""A megatron-core ``CopyService`` over plain torch.distributed point-to-point ops.

megatron-core's own services do not fit a CPU/gloo world or a long-running job: its
``GlooCopyService`` calls ``torch.cuda.Stream()`` and creates a new process group per instance
(never destroyed), and local copies need task ids.  This service works with any backend
(NCCL on GPUs, gloo on CPUs), uses a group it is given, pairs local sends/receives in submission
order, and posts every remote op of a batch with one ``batch_isend_irecv``.  Being a
``megatron.core.resharding.CopyService``, it can also drive ``swap_model_weights``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.resharding.copy_services.base import CopyService


class TorchDistCopyService(CopyService):
    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank()
        self._sends: list[tuple[torch.Tensor, int]] = []
        self._recvs: list[tuple[torch.Tensor, int]] = []

    def submit_send(self, src_tensor: torch.Tensor, dest_rank: int) -> None:
        self._sends.append((src_tensor, dest_rank))

    def submit_recv(self, dest_tensor: torch.Tensor, src_rank: int) -> None:
        self._recvs.append((dest_tensor, src_rank))

    def run(self) -> None:
        sends, recvs = self._sends, self._recvs
        self._sends, self._recvs = [], []
        local_src = [t for t, peer in sends if peer == self.rank]
        local_dst = [t for t, peer in recvs if peer == self.rank]
        if len(local_src) != len(local_dst):
            raise RuntimeError(f"rank {self.rank}: {len(local_src)} local sends but "
                               f"{len(local_dst)} local receives")
        with torch.no_grad():
            for src, dst in zip(local_src, local_dst, strict=True):
                dst.copy_(src)
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group=self.group)
               for t, peer in sends if peer != self.rank]
        ops += [dist.P2POp(dist.irecv, t, peer, group=self.group)
                for t, peer in recvs if peer != self.rank]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
