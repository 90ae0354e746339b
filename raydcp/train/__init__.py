"""Ray Train integration: collective raydcp checkpoints inside TorchTrainer workers.

- :func:`save` (every worker, together): save straight into the run's storage and
  ``ray.train.report`` the checkpoint (no upload, no second copy);
- :func:`restore`: load the run's latest checkpoint, resharded to this world size;
- :class:`TrainState`: model, optimizer, LR scheduler, step, data position and RNG;
- :func:`save_on_preemption`: an emergency checkpoint before a preemption deadline;
- :class:`RayDCPCallback`: checks and records checkpoints on the controller.

See docs/train.md.
"""
from .callback import RECORDS_NAME, RayDCPCallback, check_checkpoint
from .checkpoint import restore, save
from .preemption import save_on_preemption
from .rng import derive_seed
from .train_state import TrainState

__all__ = ["save", "restore", "TrainState", "save_on_preemption", "RayDCPCallback", "RECORDS_NAME",
           "check_checkpoint", "derive_seed"]
