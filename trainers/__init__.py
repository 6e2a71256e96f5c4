"""The trainers: one training loop, its stages, distillation losses, checkpoints, checkpoint averaging
(no ray/mlflow/optuna imports).

- ``engine``: the one loop (:func:`run_loop`) and the optimizer step (clip, Adam, AutoShuffle, schedule);
- ``loop``: the supernet trainer (:class:`~trainers.loop.SupernetRecipe`, run by :func:`train_supernet`: stages,
  checkpoints, exact resume, data-parallel);
- ``standalone_trainer``: one fixed sub-Transformer (:func:`train_standalone`: fidelity retraining, fine-tuning);
- ``stages/``: the :class:`~trainers.stages.Stage` protocol, its implementations and the stage registry;
- ``optim``, ``regularization_schedule``, ``window``, ``distributed``: Adam and the learning-rate schedule, each
  forward pass's regularisation rates, the logging window, data-parallel helpers;
- ``stage_plan``, ``distill_losses``, ``distill_targets``: Scalable Transformers' stage plan, word-level
  distillation losses and the stage-3 targets (the widest's translations);
- ``proximal``, ``average``: MAT's proximal initialization, checkpoint averaging.
"""

from trainers.average import average_checkpoints, average_snapshots, latest_snapshots
from trainers.distill_losses import soft_cross_entropy, word_distill_loss
from trainers.loop import TrainResult, check_fingerprint, supernet_fingerprint, train_supernet
from trainers.optim import inverse_sqrt_lr
from trainers.regularization_schedule import Regularization, drop_branch_at, step_regularization
from trainers.stage_plan import anneal_lambda, stage_at
from trainers.stages import STAGES, Stage, StepInfo, StepOutput
from trainers.standalone_trainer import train_standalone

__all__ = ["train_supernet", "train_standalone", "TrainResult", "inverse_sqrt_lr",
           "supernet_fingerprint", "check_fingerprint", "average_checkpoints", "average_snapshots",
           "latest_snapshots", "word_distill_loss", "soft_cross_entropy", "anneal_lambda", "stage_at",
           "drop_branch_at", "Regularization", "step_regularization", "Stage", "StepInfo", "StepOutput", "STAGES"]
