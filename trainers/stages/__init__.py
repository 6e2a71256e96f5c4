"""Training stages behind one :class:`Stage` protocol, and :data:`STAGES`, the one registry of the supernet's.

- ``base``: the :class:`Stage` protocol, :class:`StepInfo`, :class:`StepOutput`, :class:`StageContext`;
- ``sandwich``: the forward/backward pass all stages share (:func:`sandwich_step`);
- ``joint``, ``word_distill``, ``seq_distill``: Scalable Transformers' stages 1-3 (sec. 3.3, eq. 4-6);
- ``standalone``: one fixed arch (fidelity retraining, fine-tuning).

Adding a supernet stage: a module here with its class, one line in :data:`STAGES`, and its model in the
schema's ``train.stages`` (``nas.space.schema``).
"""

from __future__ import annotations

from collections.abc import Callable

from trainers.stages.base import Stage, StageContext, StepInfo, StepOutput
from trainers.stages.joint import JointTraining
from trainers.stages.base import SandwichArchs
from trainers.stages.sandwich import sandwich_step
from trainers.stages.seq_distill import SequenceDistillation
from trainers.stages.standalone import StandaloneTraining
from trainers.stages.word_distill import WordDistillation

__all__ = ["Stage", "StageContext", "StepInfo", "StepOutput", "SandwichArchs", "sandwich_step", "JointTraining",
           "WordDistillation", "SequenceDistillation", "StandaloneTraining", "STAGES", "build_stage"]

STAGES: dict[str, Callable[[StageContext], Stage]] = {
    "joint": JointTraining,
    "word_distill": WordDistillation,
    "seq_distill": SequenceDistillation,
}
"""``train.stages[*].name`` -> the stage class, built from a :class:`StageContext`."""


def build_stage(name: str, context: StageContext) -> Stage:
    """The supernet stage ``name`` (a ``train.stages[*].name``).

    Raises:
        ValueError: no stage of that name (names the known ones).
    """
    if name not in STAGES:
        raise ValueError(f"train.stages: unknown stage {name!r}; known: {', '.join(STAGES)}")
    return STAGES[name](context)
