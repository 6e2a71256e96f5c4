"""Elastic layers, the supernet, extraction and decoding (no ray/mlflow/optuna imports here).

What lives where (one concept per file):

- ``ops.py``: grouped tensor primitives (per-group linear map, drop-branch mask, attention kernel,
  dropout, sinusoidal positions);
- ``attention.py``: multi-branch attention (MAT), cropped by widths (Scalable Transformers);
- ``ffn.py``: the elastic FFN and its multi-path form with the layer norm folded in;
- ``paths.py``: Multi-Path fusion (per-path layer norms, PathNorm, alpha/beta weights);
- ``conv.py``: Prime's dynamic (causal) convolution;
- ``units.py``: MUTE unit biases, the unit combination and AutoShuffle;
- ``regularization.py``: :class:`Regularization`, the dropout/drop-branch passed to each call;
- ``kv_cache.py``: the incremental-decoding state (:class:`LayerCache`) that decoder layers take;
- ``layers.py``: encoder and decoder layers (one implementation for full and cached decoding);
- ``supernet.py``: :class:`SuperTransformer`, :func:`extract`, :func:`check_arch`;
- ``decode.py``: :class:`IncrementalDecoder` and :func:`beam_search`;
- ``losses.py``: label-smoothed NLL; ``io.py``: saving and loading models.
"""

from nas.model.decode import IncrementalDecoder, beam_search
from nas.model.kv_cache import LayerCache
from nas.model.ops import sinusoidal_positions
from nas.model.regularization import Regularization
from nas.model.supernet import SuperTransformer, check_arch, count_params, extract

__all__ = ["SuperTransformer", "extract", "count_params", "check_arch", "beam_search", "IncrementalDecoder",
           "LayerCache", "Regularization", "sinusoidal_positions"]
