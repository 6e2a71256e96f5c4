"""The supernet trainer: sandwich-rule loop in stages, distillation losses, checkpoints, checkpoint averaging
(no ray/mlflow/optuna imports)."""

from trainers.average import average_checkpoints, average_snapshots, latest_snapshots
from trainers.distill import anneal_lambda, soft_cross_entropy, stage_at, word_distill_loss
from trainers.loop import (TrainResult, build_supernet, check_fingerprint, inverse_sqrt_lr, supernet_fingerprint,
                           train_supernet)

__all__ = ["train_supernet", "TrainResult", "build_supernet", "inverse_sqrt_lr", "supernet_fingerprint",
           "check_fingerprint", "average_checkpoints", "average_snapshots", "latest_snapshots", "word_distill_loss",
           "soft_cross_entropy", "anneal_lambda", "stage_at"]
