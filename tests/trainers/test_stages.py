"""The contract every training stage satisfies (one suite over the registry, like optuna's ``StorageTestCase``):
it is built by name from its schema entry, one step leaves exactly the gradients of the sub-Transformers it
trained (checked against an independent computation of eq. 4-6), the sandwich rule, regularisation passed to the
forward and never set on the model, and a clear error for an unknown name.

Everything runs on a tiny supernet (C=32, 2+2 layers, vocabulary 50) and hand-made batches: no data, no files."""

from __future__ import annotations

import copy
import inspect
import math
import random
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from nas.builders import build_supernet
from nas.data import PAD_ID, collate
from nas.model.regularization import Regularization
from nas.space import SpecError, parse_spec
from nas.space.schema import STAGE_ORDER
from nas.space.space import SearchSpace
from tests.conftest import tiny_spec_dict
from trainers.stage_plan import stage_at
from trainers.stages import (
    STAGES,
    SandwichArchs,
    Stage,
    StageContext,
    StandaloneTraining,
    StepInfo,
    StepOutput,
    build_stage,
)

VOCAB = 50
SEED = 3
STEP = 2
"""The 0-based global step of the step under test (j = 2 of an 8-step stage)."""

CASES: dict[str, tuple[dict, float | None]] = {
    "joint": ({"name": "joint", "steps": 8}, None),
    # eq. 5 at j = 2 of t_j = 4, from 1 to 0.5: 1 - 0.5 * 2 / 4
    "word_distill": ({"name": "word_distill", "steps": 8, "lambda_start": 1.0, "lambda_end": 0.5,
                      "lambda_steps": 4}, 0.75),
    "seq_distill": ({"name": "seq_distill", "steps": 8, "lambda_3": 0.3}, 0.3),
}
"""Registered stage name -> (its ``train.stages`` entry, the weight of the targets for the sub-Transformers at
:data:`STEP`: None without distillation). A stage added to :data:`trainers.stages.STAGES` needs a line here."""

ALL = sorted(STAGES) + ["standalone"]
"""The registry, and the one stage outside it (standalone training of one fixed arch)."""


def _raw(**train):
    raw = tiny_spec_dict(Path("/nonexistent"), Path("/nonexistent"))  # no file is read
    raw["train"] = {k: v for k, v in raw["train"].items() if k != "steps"} | {"precision": "fp32", **train}
    return raw


def _spec(name: str, exact: bool = True, **train):
    """A sweep whose plan is the one stage ``name`` (standalone: a joint plan); ``exact``: no dropout or
    drop-branch, so a forward is a deterministic function of the weights."""
    entry = CASES.get(name, CASES["joint"])[0]
    raw = _raw(stages=[entry], **({"drop_branch": 0.0} if exact else {}), **train)
    if exact:
        raw["supernet"] = {**raw["supernet"], "dropout": 0.0, "attention_dropout": 0.0}
    return parse_spec(raw)


def _batch(seed: int, rows: int = 3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (2, rows), generator=g).tolist()
    return collate([torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths[0]],
                   [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths[1]])


class Built:
    """A stage ``name`` built as the trainer builds it, with its model, space and sampler RNG."""

    def __init__(self, name: str, exact: bool = True, sandwich_k: int = 1, **train):
        if name != "standalone" and name not in CASES:
            pytest.fail(f"stage {name!r} is registered in trainers.stages.STAGES but has no contract case; "
                        f"add its train.stages entry to CASES in {__file__}")
        self.name = name
        self.spec = _spec(name, exact, sandwich_k=sandwich_k, **train)
        self.space = SearchSpace.from_spec(self.spec)
        torch.manual_seed(0)
        self.model = build_supernet(self.spec, VOCAB).train()
        self.rng = random.Random(SEED)
        if name == "standalone":
            self.stage = StandaloneTraining(self.space.narrowest(), self.spec, nullcontext())
            self.lam = None
        else:
            context = StageContext(self.spec, SandwichArchs(self.space, self.rng, sandwich_k), nullcontext())
            self.stage = build_stage(name, context)
            self.lam = CASES[name][1]

    def info(self, step: int, ntokens: int) -> StepInfo:
        position = None if self.name == "standalone" else stage_at(self.spec.train.stage_plan, step)
        return StepInfo(step, ntokens, position)

    def expected_archs(self, steps: int = 1) -> list[list]:
        """Per step, what the stage must train: the standalone arch, or widest, narrowest and ``sandwich_k``
        drawn from a copy of the sampler RNG's seed."""
        if self.name == "standalone":
            return [[self.space.narrowest()]] * steps
        rng = random.Random(SEED)
        k = self.spec.train.sandwich_k
        return [[self.space.widest(), self.space.narrowest()] + [self.space.sample(rng) for _ in range(k)]
                for _ in range(steps)]


class Forwards:
    """Records (arch, reg) of every forward call of ``model`` (a forward pre-hook; nothing is replaced)."""

    def __init__(self, model):
        self.calls: list[tuple] = []
        signature = inspect.signature(model.forward)

        def hook(module, args, kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self.calls.append((module.check_arch(bound.arguments["arch"]), bound.arguments["reg"]))

        self.handle = model.register_forward_pre_hook(hook, with_kwargs=True)

    @property
    def archs(self):
        return [arch for arch, _ in self.calls]


def _reference(model, batches, archs, lam, eps, ntokens):
    """Independent eq. 4 (``lam`` None) / sec. 3.3 L_2 and eq. 6: the first arch on the targets, label-smoothed;
    each other on the targets (lam None) or ``lam * targets + (1 - lam) * the first's distribution`` (detached).
    Returns (gradients by name, the StepOutput the step should report)."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    sums = {"widest": 0.0, "nll": 0.0, "narrowest": 0.0, "sampled": 0.0, "distill": 0.0}
    for batch in batches:
        mask = batch.tgt_out != PAD_ID
        teacher = None
        for i, arch in enumerate(archs):
            lprobs = torch.log_softmax(ref(batch.src, batch.tgt_in, arch).double(), -1)
            nll = -lprobs.gather(-1, batch.tgt_out.unsqueeze(-1)).squeeze(-1)
            hard = ((1 - eps) * nll - eps * lprobs.mean(-1))[mask].sum()
            if i == 0:
                objective = hard
                teacher = lprobs.exp().detach()
                sums["nll"] += float(nll[mask].sum().detach()) / ntokens
            elif lam is None:
                objective = hard
            else:
                soft = -(teacher * lprobs).sum(-1)[mask].sum()
                objective = lam * hard + (1 - lam) * soft
                sums["distill"] += float(soft.detach()) / ntokens
            (objective / ntokens).backward()
            sums["widest" if i == 0 else "narrowest" if i == 1 else "sampled"] += float(hard.detach()) / ntokens
    return {n: p.grad for n, p in ref.named_parameters()}, StepOutput(**sums)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


# ---- the registry and the protocol ------------------------------------------------------------------------

def test_the_registry_has_one_stage_per_schema_stage_name():
    assert sorted(STAGES) == sorted(STAGE_ORDER)


@pytest.mark.parametrize("name", ALL)
def test_each_stage_builds_from_its_schema_entry_and_has_the_protocols_step(name):
    built = Built(name)
    if name != "standalone":
        assert [s.name for s in built.spec.train.stage_plan] == [name]  # the YAML entry parses to this name
        assert type(built.stage) is STAGES[name]
    # Stage is a typing.Protocol without @runtime_checkable (isinstance would raise): check its one method by hand,
    # and isinstance too should it become runtime-checkable
    if getattr(Stage, "_is_runtime_protocol", False):
        assert isinstance(built.stage, Stage)
    step = getattr(built.stage, "step", None)
    assert callable(step)
    assert list(inspect.signature(step).parameters) == list(inspect.signature(Stage.step).parameters)[1:]


def test_an_unknown_stage_name_is_refused_naming_it_and_the_known_ones():
    built = Built("joint")
    with pytest.raises(ValueError) as info:
        build_stage("word_distil", built.stage.context)
    message = str(info.value)
    assert "'word_distil'" in message
    for name in STAGES:
        assert name in message


def test_an_unknown_stage_name_in_the_yaml_is_refused_naming_it_and_where():
    with pytest.raises(SpecError) as info:
        parse_spec(_raw(stages=[{"name": "joint", "steps": 2}, {"name": "word_distil", "steps": 2}]), "x.yaml")
    message = str(info.value)
    assert "x.yaml" in message and "train.stages.1" in message and "'word_distil'" in message
    for name in STAGES:
        assert name in message


# ---- one step ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_one_step_leaves_the_gradients_of_the_archs_it_trained_and_only_those(name):
    built = Built(name)
    batches = [_batch(1), _batch(2)]
    ntokens = sum(b.ntokens for b in batches)
    forwards = Forwards(built.model)
    out = built.stage.step(built.model, batches, built.info(STEP, ntokens))
    forwards.handle.remove()

    (archs,) = built.expected_archs()
    assert forwards.archs == archs * len(batches)  # the same sub-Transformers on each batch of the step
    assert isinstance(out, StepOutput)
    assert all(math.isfinite(v) for v in out.to_dict().values())

    grads, expected = _reference(built.model, batches, archs, built.lam, built.spec.train.label_smoothing, ntokens)
    got = {n: p.grad for n, p in built.model.named_parameters()}
    trained = {n for n, g in grads.items() if g is not None}
    assert {n for n, g in got.items() if g is not None} == trained
    if name == "standalone":  # the narrowest has 1 of 2 encoder layers: the other one is not trained
        assert not any(n.startswith("encoder.1.") for n in trained)
    for n in trained:
        assert torch.isfinite(got[n]).all(), n
        torch.testing.assert_close(got[n], grads[n].to(got[n].dtype), rtol=1e-4, atol=1e-6, msg=n)
    for field, value in expected.to_dict().items():
        assert getattr(out, field) == pytest.approx(value, rel=1e-5, abs=1e-9), field
    assert out.widest > 0 and (out.narrowest > 0) == (name != "standalone")
    assert (out.sampled > 0) == (name != "standalone") and (out.distill > 0) == (built.lam is not None)


@pytest.mark.parametrize("name", ["word_distill", "seq_distill"])
def test_a_distillation_stage_refuses_a_step_outside_its_stage(name):
    built = Built(name)
    batch = _batch(1)
    with pytest.raises(ValueError, match="distillation needs a position"):
        built.stage.step(built.model, [batch], StepInfo(STEP, batch.ntokens, None))
    joint = stage_at(_spec("joint").train.stage_plan, STEP)
    with pytest.raises(ValueError, match="distillation needs a position"):
        built.stage.step(built.model, [batch], StepInfo(STEP, batch.ntokens, joint))


# ---- the sandwich rule ------------------------------------------------------------------------------------

def test_the_joint_stage_trains_the_widest_the_narrowest_and_k_sampled_every_step():
    """Yu & Huang 2019 sec. 3.2: both ends every step plus ``sandwich_k`` drawn once per step from the sampler
    RNG (so each accumulated batch sees the same ones, and a resumed run draws the same)."""
    built = Built("joint", sandwich_k=2)
    batches = [_batch(1), _batch(2)]
    ntokens = sum(b.ntokens for b in batches)
    forwards = Forwards(built.model)
    expected = built.expected_archs(steps=3)
    for step in range(3):
        forwards.calls.clear()
        built.model.zero_grad(set_to_none=True)
        built.stage.step(built.model, batches, built.info(step, ntokens))
        assert forwards.archs == expected[step] * 2, step
        archs = forwards.archs[:4]
        assert archs[0] == built.space.widest() and archs[1] == built.space.narrowest()
        assert archs[0] != archs[1]
    assert built.rng.getstate() == _advanced(SEED, built.space, 3 * 2)  # k draws per step, no more
    sampled = [tuple(step[2:]) for step in expected]
    assert len(set(sampled)) == 3  # the draws change from step to step


def _advanced(seed, space, draws):
    rng = random.Random(seed)
    for _ in range(draws):
        space.sample(rng)
    return rng.getstate()


def test_sandwich_k_0_trains_only_the_two_ends():
    built = Built("joint", sandwich_k=0)
    batch = _batch(1)
    forwards = Forwards(built.model)
    out = built.stage.step(built.model, [batch], built.info(0, batch.ntokens))
    assert forwards.archs == [built.space.widest(), built.space.narrowest()]
    assert out.sampled == 0.0


def two_layouts(name: str, supernet: dict | None = None, **train):
    """(spec, space, supernet, stage ``name``) of a space whose layers choose sequential or Prime (kernel 3)."""
    raw = _raw(**train)
    raw["supernet"] = {**raw["supernet"], "kernels": [3], **(supernet or {})}
    raw["space"] = {**raw["space"], "layout": {"values": ["sequential", "prime"], "per_layer": True},
                    "kernels": {"values": [[], [3]], "per_layer": True, "when": {"layout": "prime"}}}
    spec = parse_spec(raw)
    space = SearchSpace.from_spec(spec)
    torch.manual_seed(0)
    model = build_supernet(spec, VOCAB).train()
    k = spec.train.sandwich_k
    return spec, space, model, build_stage(name, StageContext(spec, SandwichArchs(space, random.Random(SEED), k),
                                                              nullcontext()))


@pytest.mark.parametrize("name", sorted(STAGES))
def test_the_sandwich_ends_take_every_layout_in_turn(name):
    """Issue 14 part 1.4: with sequential and Prime layers in the space, a Prime layer must be at the ends of
    the sandwich as often as a sequential one (not only when a random draw picks it)."""
    spec, space, model, stage = two_layouts(name, stages=[CASES[name][0]], sandwich_k=0)
    forwards = Forwards(model)
    batch = _batch(1)
    seen = []
    for step in range(4):
        forwards.calls.clear()
        stage.step(model, [batch], StepInfo(step, batch.ntokens, stage_at(spec.train.stage_plan, step)))
        seen.append([set(a.encoder.layout + a.decoder.layout) for a in forwards.archs])
    assert seen == [[{"sequential"}] * 2, [{"prime"}] * 2] * 2
    ends = [space.widest("prime"), space.narrowest("prime")]
    assert all(layer.layout == "prime" for a in ends for layer in a.encoder.layer_dims())
    assert ends[0].encoder.kernels[0] == (3,) and ends[1].encoder.kernels[0] == ()
    with pytest.raises(ValueError, match="layout 'diagonal' is not in the space"):
        space.widest("diagonal")


# ---- regularisation is passed, not set --------------------------------------------------------------------

def _model_regularisation(model):
    return {"dropout_rate": model.dropout_rate, "attention_dropout": model.attention_dropout,
            "drop_branch": model.drop_branch, "unit_bias_rate": model.unit_bias_rate, "training": model.training,
            "config": model.config(),
            "nn.Dropout": [(n, m.p) for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)],
            "modules_training": [m.training for m in model.modules()]}


@pytest.mark.parametrize("name", ALL)
def test_a_step_passes_the_scheduled_regularisation_and_sets_nothing_on_the_model(name):
    rho, warmup = 0.2, 4
    built = Built(name, exact=False, drop_branch=rho, drop_branch_warmup=warmup)
    model = built.model
    assert model.drop_branch == rho and model.dropout_rate == 0.1  # the supernet's configured rates
    before = _model_regularisation(model)
    forwards = Forwards(model)
    batch = _batch(1)
    for step in range(6):
        forwards.calls.clear()
        model.zero_grad(set_to_none=True)
        built.stage.step(model, [batch], built.info(step, batch.ntokens))
        expected_rho = rho * min(step / warmup, 1.0)  # linear from 0 over the warm-up, then rho
        assert forwards.calls, step
        for arch, reg in forwards.calls:
            assert isinstance(reg, Regularization), (step, reg)
            assert reg.drop_branch == pytest.approx(expected_rho, abs=1e-12), step
            assert reg.dropout == model.dropout_rate and reg.attention_dropout == model.attention_dropout
        assert _model_regularisation(model) == before, step


def test_the_passed_dropout_rate_changes_the_step_and_the_model_forgets_it():
    """A stage with dropout makes a different (random) step than the exact one from the same weights and
    batch, and afterwards the model's own forward (reg=None) is the deterministic one it was before."""
    exact, noisy = Built("joint", exact=True), Built("joint", exact=False)
    noisy.model.load_state_dict(exact.model.state_dict())
    batch = _batch(1)
    src = batch.src
    plain = noisy.model(src, batch.tgt_in)
    outs = [b.stage.step(b.model, [batch], b.info(0, batch.ntokens)) for b in (exact, noisy)]
    assert outs[0].widest != outs[1].widest
    assert torch.equal(noisy.model(src, batch.tgt_in), plain)
