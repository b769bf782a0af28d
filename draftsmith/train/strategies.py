"""Lightning's FSDP and DeepSpeed strategies on CPU processes (gloo), for CPU-only hosts and tests.

Lightning 2.6 ships both as CUDA-only; the sharding itself runs on CPU. What stands in the way,
and what each class here changes (nothing else):

- FSDP: the trainer refuses ``fsdp`` without a GPU (only for the exact ``FSDPStrategy`` class);
  torch's FSDP needs ``device_id=cpu`` (Lightning passes the device index, None on CPU: "FSDP
  needs a non-CPU accelerator device"); and full state dicts with ``offload_to_cpu=True``, as
  Lightning asks for them, free CPU storage still in use: for the weights a segfault at the
  first checkpoint (Lightning-AI/pytorch-lightning#21804), for the optimizer a wrong AdamW
  ``exp_avg`` saved without a word, so a resumed run drifts off. Checkpoints stay Lightning's:
  a ``.ckpt`` file (``state_dict_type: full``, the default) or a sharded directory.
- DeepSpeed (``pip install deepspeed``; it picks its CPU accelerator and gloo without CUDA):
  ``setup_environment`` raises "only supported on CUDA GPUs", ``setup_distributed`` checks
  GPU indices, and ``deepspeed.initialize`` gets ``device_rank=None``. ``fit`` only: the
  inference engine of ``validate`` / ``test`` is not adapted.

``draftsmith train`` swaps these in for ``trainer.strategy: fsdp`` / ``deepspeed`` on CPU
(``cpu_strategy``); with a ``class_path`` name them directly, e.g.
``draftsmith.train.strategies.CPUDeepSpeedStrategy`` with ``init_args.stage: 3``.
"""

from __future__ import annotations

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, Strategy
from torch.nn import Module
from torch.optim import Optimizer

# Lightning's class paths that refuse CPU -> the stand-in to name instead (same init_args).
GPU_ONLY = {
    "lightning.pytorch.strategies.FSDPStrategy": "draftsmith.train.strategies.CPUFSDPStrategy",
    "lightning.pytorch.strategies.DeepSpeedStrategy": (
        "draftsmith.train.strategies.CPUDeepSpeedStrategy"
    ),
}


class CPUFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` (same arguments) whose processes shard over CPU memory and gloo."""

    def _setup_model(self, model: Module) -> Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),  # None would make FSDP look for an accelerator
                **self.kwargs,
            )
        return super()._setup_model(model)  # already wrapped: Lightning's remaining setup

    def lightning_module_state_dict(self) -> dict:
        if self._state_dict_type != "full":
            return super().lightning_module_state_dict()
        with self._full_state_dict():
            return self.model.state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict:
        if self._state_dict_type != "full":
            return super().optimizer_state(optimizer)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import OptimStateKeyType

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
        with self._full_state_dict():
            state = FSDP.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:  # keyed by parameter index, as Lightning saves it
                state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
        return state

    def _full_state_dict(self):
        """Lightning's full state dict context (on rank 0) without ``offload_to_cpu``: the
        shards are in CPU memory already, and "offloading" them frees storage still in use
        (weights: a segfault; AdamW's ``exp_avg``: wrong values, and resumed runs diverge)."""
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            StateDictType,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP.state_dict_type(
            self.model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        )


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` (same arguments; ZeRO-2 and ZeRO-3 tested) on CPU processes."""

    def setup_environment(self) -> None:
        super(DeepSpeedStrategy, self).setup_environment()  # skips the CUDA-only check

    def setup_distributed(self) -> None:
        import deepspeed.ops

        # DeepSpeed's shared-memory all-reduce serves its tensor-parallel inference only, and
        # building it is a minute of C++ compiling on first use: leave it out.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        reset_seed()  # as DeepSpeedStrategy, less its check of GPU indices
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import deepspeed

        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=None,  # DeepSpeed then takes the local rank, not Lightning's device index (None)
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer

    def _initialize_deepspeed_inference(self, model: Module) -> None:
        raise RuntimeError(  # Lightning's own would fail on device_rank=None, less clearly
            "CPUDeepSpeedStrategy runs `fit` (its validation included) only; for `validate` or "
            "`test` on CPU use trainer.strategy: ddp, or export the checkpoint and evaluate that"
        )


def runs_on_cpu(accelerator: object) -> bool:
    """Whether ``trainer.accelerator`` means CPU processes (``cpu``, or ``auto`` without CUDA)."""
    return accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())


def cpu_strategy(strategy: object, accelerator: object) -> Strategy | None:
    """The CPU stand-in for ``trainer.strategy: fsdp`` or ``deepspeed`` on CPU; else None."""
    stand_ins = {"fsdp": CPUFSDPStrategy, "deepspeed": CPUDeepSpeedStrategy}
    if not isinstance(strategy, str) or strategy not in stand_ins or not runs_on_cpu(accelerator):
        return None
    return stand_ins[strategy]()
