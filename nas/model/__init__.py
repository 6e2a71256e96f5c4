"""Elastic layers, the supernet, extraction and decoding (no ray/mlflow/optuna imports here)."""

from nas.model.decode import beam_search
from nas.model.supernet import SuperTransformer, count_params, extract

__all__ = ["SuperTransformer", "extract", "count_params", "beam_search"]
