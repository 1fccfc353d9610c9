"""Where an engine instance computes: Triton's instance kind and device id -> one torch device
per rank, and the torch.distributed backend those devices need.

A KIND_CPU instance runs every rank on the CPU (gloo). A KIND_GPU instance owns the GPUs
`device_id .. device_id + world_size - 1`, rank r on `device_id + r`: NCCL allows one rank per
GPU, so a 2-rank engine on an 8-GPU node is four instances listed as `gpus: [0]`, `[2]`, `[4]`,
`[6]` in `instance_group` (see docs/engines.md, "GPU serving").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CPU = torch.device("cpu")


class PlacementError(ValueError):
    """The instance cannot be placed as configured (names what is missing)."""


@dataclass(frozen=True)
class Placement:
    kind: str = "CPU"  # Triton's model_instance_kind: CPU, GPU (MODEL counts as CPU)
    device_id: int = 0  # Triton's model_instance_device_id: the instance's first GPU

    @classmethod
    def from_triton_args(cls, args: dict[str, str]) -> Placement:
        """From the `args` Triton passes to a Python model's `initialize`."""
        return cls(args.get("model_instance_kind", "CPU").upper(),
                   int(args.get("model_instance_device_id", "0") or 0))

    @property
    def on_gpu(self) -> bool:
        return self.kind.upper() == "GPU"

    def devices(self, world_size: int, gpu_count: int | None = None) -> list[torch.device]:
        """Rank r's device, r = 0 .. world_size - 1. `gpu_count`: GPUs visible (default: ask
        CUDA)."""
        if not self.on_gpu:
            return [CPU] * world_size
        count = torch.cuda.device_count() if gpu_count is None else gpu_count
        if count == 0:
            raise PlacementError(
                "a KIND_GPU instance, but no CUDA device is visible (a CPU-only torch build, "
                "or CUDA_VISIBLE_DEVICES hides them); use KIND_CPU")
        last = self.device_id + world_size - 1
        if self.device_id < 0 or last >= count:
            raise PlacementError(
                f"a {world_size}-rank engine on GPU {self.device_id} needs GPUs "
                f"{self.device_id}..{last}, but {count} are visible; list one GPU per "
                f"instance in instance_group's `gpus`, {world_size} apart")
        return [torch.device("cuda", self.device_id + r) for r in range(world_size)]


def dist_backend(device: torch.device) -> str:
    """torch.distributed backend for ranks on `device`: gloo on CPU; on GPU, NCCL for the
    tensors and gloo for the CPU-side control messages (the step broadcast, barriers)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
