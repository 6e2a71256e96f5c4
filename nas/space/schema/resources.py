"""The sweep YAML's ``resources:`` section: CPUs, GPUs and workers of the supernet-training trial, and where Ray
Tune keeps its experiments (:class:`ResourcesSpec`). Pydantic only.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from nas.space.schema.base import StrictModel

__all__ = ["ResourcesSpec"]


class ResourcesSpec(StrictModel):
    cpu: float = Field(2.0, gt=0)
    """CPUs for the supernet-training trial (per worker when ``workers`` > 1)."""
    gpu: float = Field(0.0, ge=0)
    """GPUs for the supernet-training trial (per worker when ``workers`` > 1)."""
    workers: int = Field(1, ge=1)
    """Data-parallel workers for supernet training (Ray Train ``TorchTrainer``, DDP; NCCL on GPUs, else gloo).
    Each worker takes its share of every batch, so the global batch stays ``train.max_tokens``."""
    storage_path: str | None = None
    """Where Ray Tune keeps both stages' experiments (``RunConfig(storage_path)``): a folder every node of the
    cluster sees, or a URI such as ``s3://bucket/prefix``; default: ``<workdir>/<name>/ray``."""

    @field_validator("storage_path")
    @classmethod
    def _check_storage_path(cls, path: str | None) -> str | None:
        if path is not None and not path.strip():
            raise ValueError("is empty; give a shared folder or a URI such as s3://bucket/prefix, or leave it out")
        return path
