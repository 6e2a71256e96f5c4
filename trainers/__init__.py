"""The supernet trainer: sandwich-rule loop, losses, checkpoints (no ray/mlflow/optuna imports)."""

from trainers.loop import (TrainResult, build_supernet, check_fingerprint, inverse_sqrt_lr, supernet_fingerprint,
                           train_supernet)

__all__ = ["train_supernet", "TrainResult", "build_supernet", "inverse_sqrt_lr", "supernet_fingerprint",
           "check_fingerprint"]
