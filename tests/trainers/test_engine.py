"""The one training loop (:func:`trainers.engine.run_loop`, :func:`~trainers.engine.optimizer_step`) that the
supernet, standalone retraining and the fine-tune stage share: determinism, exact resume from the loop's state,
the data order over epochs and corpora, gradient clipping, the warm-up/inverse-square-root learning rate.

The loop tests run the real joint stage on a tiny supernet (vocabulary 50) over hand-made token batches; the
last ones go through :func:`trainers.train_standalone` and :func:`trainers.train_supernet` on the Multi30k slice."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from nas.builders import build_supernet, prepare_sweep_data
from nas.data import TokenBatcher
from nas.precision import DeviceSettings, device_settings
from nas.space import parse_spec
from nas.space.space import SearchSpace
from tests.conftest import tiny_spec_dict, use_tiny_data
from trainers import train_standalone, train_supernet
from trainers.engine import LoopHooks, optimizer_step, run_loop
from trainers.optim import batch_groups, make_optimizer, make_scheduler
from trainers.stages import SandwichArchs, StageContext, StepInfo, build_stage

VOCAB = 50
ACCUMULATE = 2
BATCHES_PER_EPOCH = 5
"""With :func:`_batcher`'s pairs: 5 batches, so with ``ACCUMULATE`` 2 an epoch is 3 steps (2 + 2 + 1 batches)."""


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _spec(**train):
    raw = tiny_spec_dict(Path("/nonexistent"), Path("/nonexistent"))  # no file is read
    raw["train"] = {**raw["train"], "precision": "fp32", "warmup_steps": 3, "lr": 2e-3, "clip_norm": 0.5, **train}
    return parse_spec(raw)


def _batcher(seed: int = 0, pairs: int = 20) -> TokenBatcher:
    g = torch.Generator().manual_seed(seed)
    src, tgt = ([torch.randint(4, VOCAB, (int(n),), generator=g).tolist()
                 for n in torch.randint(2, 10, (pairs,), generator=g)] for _ in range(2))
    return TokenBatcher(src, tgt, 48, shuffle=True, seed=seed)


class Recording:
    """A :class:`~trainers.stages.Stage` that runs ``inner`` and records what each step got: its batches' source
    tensors, the learning rate its update will use, and the gradients' total 2-norm before clipping
    (computed here in float64)."""

    def __init__(self, inner, model, optimizer):
        self.inner, self.model, self.optimizer = inner, model, optimizer
        self.sources: list[list[torch.Tensor]] = []
        self.lrs: list[float] = []
        self.norms: list[float] = []

    def step(self, model, batches, step):
        out = self.inner.step(model, batches, step)
        self.sources.append([b.src.clone() for b in batches])
        self.lrs.append(self.optimizer.param_groups[0]["lr"])
        grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
        self.norms.append(math.sqrt(sum(float((g * g).sum()) for g in grads)))
        return out


class Run:
    """What a trainer holds: model, Adam, schedule, sampler RNG, the joint stage, the loop state; ``checkpoint`` and
    ``resumed`` do what ``trainers.loop`` stores and restores."""

    def __init__(self, spec, seed: int = 0, batchers: dict[str, TokenBatcher] | None = None, corpus_at=None):
        self.spec = spec
        tr = spec.train
        torch.manual_seed(seed)
        self.model = build_supernet(spec, VOCAB).train()
        self.optimizer = make_optimizer(self.model, tr.lr, tr.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, tr.warmup_steps)
        self.rng = random.Random(seed)
        context = StageContext(spec, SandwichArchs(SearchSpace.from_spec(spec), self.rng, tr.sandwich_k), nullcontext())
        self.stage = Recording(build_stage("joint", context), self.model, self.optimizer)
        self.state = {"step": 0, "epoch": 0, "position": 0, "corpus": "train"}
        self.batchers = batchers or {"train": _batcher()}
        self.corpus_at = corpus_at or (lambda step: "train")
        self.results = []
        self.after = lambda result: None

    def run(self, steps: int, accumulate: int = ACCUMULATE, device=None, reads_at=lambda step: True) -> Run:
        def after_step(result):
            self.results.append(result)
            self.after(result)

        hooks = LoopHooks(stage_at=lambda step: (self.stage, None), corpus_at=self.corpus_at,
                          batcher=self.batchers.__getitem__, after_step=after_step,
                          describe=lambda step: f"test step {step}", reads_at=reads_at)
        run_loop(self.model, self.optimizer, self.scheduler, self.state, hooks, steps=steps, accumulate=accumulate,
                 clip_norm=self.spec.train.clip_norm, device=device or torch.device("cpu"))
        return self

    def checkpoint(self) -> dict:
        return copy.deepcopy({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                              "scheduler": self.scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
                              "sampler_rng": self.rng.getstate(), "state": self.state})

    @classmethod
    def resumed(cls, spec, ckpt: dict, **kw) -> Run:
        run = cls(spec, seed=12345, **kw)  # another initialisation and RNG: everything must come from ckpt
        run.model.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])
        run.scheduler.load_state_dict(ckpt["scheduler"])
        torch.set_rng_state(ckpt["torch_rng"])
        run.rng.setstate(ckpt["sampler_rng"])
        run.state = copy.deepcopy(ckpt["state"])
        return run

    def losses(self) -> list[dict]:
        return [r.output.to_dict() for r in self.results]


def _assert_same_params(a, b):
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name


def _flat(sources: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [s for step in sources for s in step]


def _same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


# ---- determinism and resume -------------------------------------------------------------------------------

def test_two_runs_with_the_same_seed_are_identical_and_another_seed_differs():
    spec = _spec()  # dropout 0.1 and drop-branch 0.1: the torch RNG matters
    assert spec.supernet.dropout > 0 and spec.drop_branch > 0
    a, b, c = Run(spec).run(7), Run(spec).run(7), Run(spec, seed=1).run(7)
    assert len(a.results) == 7
    assert a.losses() == b.losses()
    assert [r.grad_norm for r in a.results] == [r.grad_norm for r in b.results]
    assert [r.ntokens for r in a.results] == [r.ntokens for r in b.results]
    _assert_same_params(a.model, b.model)
    assert a.losses() != c.losses()


@pytest.mark.parametrize("k", [1, 3, 4], ids=["after_1", "at_the_end_of_epoch_0", "inside_epoch_1"])
def test_k_steps_then_a_resume_from_the_checkpointed_state_equals_n_steps(k):
    spec = _spec()
    n = 8
    straight = Run(spec).run(n)
    assert len(straight.batchers["train"]) == BATCHES_PER_EPOCH and straight.state["epoch"] == 2  # crosses epochs

    first = Run(spec).run(k)
    assert first.state["step"] == k
    second = Run.resumed(spec, first.checkpoint()).run(n)
    assert first.losses() + second.losses() == straight.losses()
    assert [r.step for r in second.results] == list(range(k + 1, n + 1))
    assert [r.grad_norm for r in first.results + second.results] == [r.grad_norm for r in straight.results]
    assert _same_tensors(_flat(first.stage.sources + second.stage.sources), _flat(straight.stage.sources))
    _assert_same_params(second.model, straight.model)
    assert second.state == straight.state


def test_calling_the_loop_again_with_more_steps_goes_on_where_it_stopped():
    spec = _spec()
    straight = Run(spec).run(5)
    again = Run(spec).run(2).run(2).run(5)
    assert again.losses() == straight.losses()
    weights = copy.deepcopy(again.model.state_dict())
    again.run(5)  # at `steps` already: nothing more
    assert len(again.results) == 5 and again.state["step"] == 5
    for name, p in again.model.state_dict().items():
        assert torch.equal(p, weights[name]), name


# ---- the data order ---------------------------------------------------------------------------------------

def test_each_step_takes_accumulate_consecutive_batches_and_epochs_follow_each_other():
    run = Run(_spec()).run(7)
    batcher = run.batchers["train"]
    expected = []
    for epoch in range(3):  # 3 steps per epoch: 2 + 2 + 1 batches
        expected += [[b.src for b in group] for group in batch_groups(batcher.batches(epoch), ACCUMULATE)]
    assert [len(s) for s in run.stage.sources] == [2, 2, 1, 2, 2, 1, 2]
    for step, (got, want) in enumerate(zip(run.stage.sources, expected)):
        assert _same_tensors(got, want), step
    epochs = [batcher.epoch(e) for e in range(2)]
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == sorted(epochs[1])  # reshuffled, the same batches
    assert all(result.position is None for result in run.results)  # no stage plan: standalone-style hooks
    assert run.state == {"step": 7, "epoch": 2, "position": 2, "corpus": "train"}


def test_a_change_of_corpus_starts_the_new_corpus_at_epoch_0_batch_0():
    batchers = {"a": _batcher(0), "b": _batcher(7, pairs=24)}
    assert len(batchers["b"]) == 6  # 2 steps stay inside "b"'s epoch 0
    run = Run(_spec(), batchers=batchers, corpus_at=lambda step: "a" if step < 4 else "b")
    run.state["corpus"] = "a"
    run.run(6)
    a = [[b.src for b in g] for e in range(2) for g in batch_groups(batchers["a"].batches(e), ACCUMULATE)]
    b = [[x.src for x in g] for g in batch_groups(batchers["b"].batches(0), ACCUMULATE)]
    assert _same_tensors(_flat(run.stage.sources), _flat(a[:4] + b[:2]))  # "a" left inside its epoch 1
    assert run.state["corpus"] == "b" and run.state["epoch"] == 0 and run.state["position"] == 4


def test_the_step_result_counts_the_target_tokens_of_all_its_batches():
    run = Run(_spec())
    batcher = run.batchers["train"]
    run.run(3)
    groups = list(batch_groups(batcher.batches(0), ACCUMULATE))
    assert [r.ntokens for r in run.results] == [sum(b.ntokens for b in g) for g in groups]
    assert [r.step for r in run.results] == [1, 2, 3]


# ---- gradient clipping ------------------------------------------------------------------------------------

def _with_gradients(spec, seed: int = 0):
    """A model, its Adam and schedule, with the gradients of one joint step in it."""
    run = Run(spec, seed=seed)
    batch = next(run.batchers["train"].batches(0))
    run.stage.inner.step(run.model, [batch], StepInfo(0, batch.ntokens))
    return run


def _independent_step(model, clip_norm, lr):
    """A copy of ``model`` (with its gradients) clipped by torch.nn.utils.clip_grad_norm_ and stepped by a fresh
    torch Adam at ``lr``: what optimizer_step's first update must give."""
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()
    norm = float(torch.nn.utils.clip_grad_norm_(twin.parameters(), clip_norm))
    torch.optim.Adam(twin.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-8).step()
    return twin, norm


@pytest.mark.parametrize("clip_norm", [0.05, 1e3], ids=["clipped", "below_the_limit"])
def test_optimizer_step_clips_to_clip_norm_steps_adam_and_returns_the_norm_before_clipping(clip_norm):
    run = _with_gradients(_spec())
    model = run.model
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    by_hand = math.sqrt(sum(float((g.double() ** 2).sum()) for g in before.values()))
    lr = run.optimizer.param_groups[0]["lr"]
    twin, twin_norm = _independent_step(model, clip_norm, lr)

    reported = optimizer_step(model, run.optimizer, run.scheduler, clip_norm, "step 1")
    assert reported == pytest.approx(by_hand, rel=1e-5) and reported == pytest.approx(twin_norm, rel=1e-6)
    scale = min(1.0, clip_norm / (by_hand + 1e-6))
    assert (scale < 1.0) == (clip_norm < 1.0)
    after = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))
    assert after == pytest.approx(min(by_hand, clip_norm), rel=1e-4)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, before[name] * scale, rtol=1e-5, atol=1e-9, msg=name)
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert run.scheduler.last_epoch == 1  # the schedule moved one step


def test_a_non_finite_gradient_norm_names_the_step_and_updates_nothing():
    run = _with_gradients(_spec())
    weights = copy.deepcopy(run.model.state_dict())
    next(run.model.parameters()).grad[0, 0] = float("nan")
    lr = run.optimizer.param_groups[0]["lr"]
    with pytest.raises(FloatingPointError, match="non-finite gradient norm at standalone step 7 of x"):
        optimizer_step(run.model, run.optimizer, run.scheduler, 1.0, "standalone step 7 of x")
    for name, p in run.model.state_dict().items():
        assert torch.equal(p, weights[name]), name
    assert run.optimizer.state_dict()["state"] == {} and run.scheduler.last_epoch == 0
    assert run.optimizer.param_groups[0]["lr"] == lr


def _poison(run: Run, at: int, value: float) -> None:
    """Make ``run``'s stage fill the first parameter's gradient with ``value`` at 0-based step ``at``."""
    inner = run.stage.step

    def poisoned(model, batches, step):
        out = inner(model, batches, step)
        if step.step == at:
            next(model.parameters()).grad.fill_(value)
        return out

    run.stage.step = poisoned


def test_the_loop_stops_at_a_non_finite_gradient_without_counting_the_step():
    spec = _spec()
    run = Run(spec)
    _poison(run, 2, float("inf"))
    with pytest.raises(FloatingPointError, match="non-finite gradient norm at test step 3"):
        run.run(5)
    assert run.state["step"] == 2 and len(run.results) == 2


# ---- the CUDA path's settings, run on CPU (nas.precision.DeviceSettings) ------------------------------------

DEFERRED = DeviceSettings(torch.device("cpu"), fused_adam=False, pin_memory=False, deferred_checks=True, tf32=False)
"""CUDA's inner loop on CPU: no host synchronisation per step, the gradient norms checked at read steps only."""


def test_cuda_gets_every_device_setting_and_cpu_none():
    assert device_settings("cuda") == DeviceSettings(torch.device("cuda"), True, True, True, True)
    assert device_settings("cpu") == DeviceSettings(torch.device("cpu"), False, False, False, False)


def test_deferred_checks_take_exactly_the_steps_of_checked_ones_and_keep_the_losses_on_the_device():
    spec = _spec()
    checked = Run(spec).run(7)
    deferred = Run(spec).run(7, device=DEFERRED, reads_at=lambda step: step % 3 == 0)
    assert deferred.losses() == checked.losses()
    assert [float(r.grad_norm) for r in deferred.results] == [float(r.grad_norm) for r in checked.results]
    _assert_same_params(deferred.model, checked.model)
    out = deferred.results[0].output
    assert isinstance(out.widest, torch.Tensor) and out.widest.dtype == torch.float64  # not read back to the host
    assert isinstance(deferred.results[0].grad_norm, torch.Tensor)


def test_fused_adam_takes_the_steps_of_the_default_adam_up_to_rounding():
    spec = _spec()
    default = Run(spec).run(5)
    fused = Run(spec)
    fused.optimizer = make_optimizer(fused.model, spec.train.lr, spec.train.weight_decay, fused=True)
    fused.scheduler = make_scheduler(fused.optimizer, spec.train.warmup_steps)
    fused.stage.optimizer = fused.optimizer
    start = copy.deepcopy(fused.model.state_dict())
    fused.run(5, device=dataclasses.replace(DEFERRED, fused_adam=True))
    assert any(group.get("fused") for group in fused.optimizer.param_groups)
    moved = max(float((p.detach() - start[name]).abs().max()) for name, p in fused.model.named_parameters())
    assert moved > 5e-3  # 5 steps at lr 2e-3 moved the weights 50x the tolerance below
    for (name, p), q in zip(fused.model.named_parameters(), default.model.parameters()):
        # atol: the key projection's bias has a zero true gradient (softmax ignores it), so Adam's m/sqrt(v) of
        # its rounding noise differs by up to ~4e-5 between the two implementations; every other weight by 1e-7
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-4, msg=name)


def test_deferred_checks_raise_at_the_next_read_step_naming_the_first_bad_step_before_its_hooks():
    spec = _spec()
    run = Run(spec)
    _poison(run, 2, float("inf"))  # the third step
    with pytest.raises(FloatingPointError, match=r"non-finite gradient norm at test step 3 \(found at test step 4"):
        run.run(8, device=DEFERRED, reads_at=lambda step: step % 4 == 0)
    assert [r.step for r in run.results] == [1, 2, 3]  # step 4's hooks (its log or checkpoint) never ran


def test_deferred_checks_check_the_last_steps_when_the_loop_ends_between_read_steps():
    run = Run(_spec())
    _poison(run, 4, float("nan"))
    with pytest.raises(FloatingPointError, match="non-finite gradient norm at test step 5"):
        run.run(5, device=DEFERRED, reads_at=lambda step: False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_inner_loop_never_waits_for_the_device():
    spec = _spec()
    run = Run(spec)
    run.model.cuda()
    run.optimizer = make_optimizer(run.model, spec.train.lr, spec.train.weight_decay, fused=True)
    run.scheduler = make_scheduler(run.optimizer, spec.train.warmup_steps)
    run.stage = run.stage.inner  # Recording reads the gradients
    run.run(2, device=device_settings("cuda"))  # warm-up: allocations
    torch.cuda.set_sync_debug_mode("error")
    try:
        run.run(6, device=device_settings("cuda"), reads_at=lambda step: False)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_loop_reports_the_norm_before_clipping_and_steps_with_the_clipped_gradients():
    spec = _spec(clip_norm=0.01)
    run = Run(spec)
    after = []
    run.after = lambda result: after.append(  # the gradients are zeroed only at the next step
        math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in run.model.parameters() if p.grad is not None)))
    run.run(4)
    reported = [r.grad_norm for r in run.results]
    assert reported == pytest.approx(run.stage.norms, rel=1e-5)
    assert all(n > 0.01 for n in reported)
    assert after == pytest.approx([0.01] * 4, rel=1e-4)


# ---- the learning-rate schedule ---------------------------------------------------------------------------

def _vaswani(peak: float, warmup: int, step: int) -> float:
    """Vaswani et al. 2017 eq. 3 normalised to ``peak`` at ``warmup``: linear up to it, then ``1/sqrt(step)``."""
    if step <= warmup:
        return peak * step / warmup
    return peak * (warmup / step) ** 0.5


@pytest.mark.parametrize("warmup", [1, 4, 10])
def test_after_s_steps_the_rate_is_the_warmup_then_inverse_square_root(warmup):
    peak = 3e-3
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.Adam([param], lr=peak)
    scheduler = make_scheduler(optimizer, warmup)
    rates = [optimizer.param_groups[0]["lr"]]
    for _ in range(40):
        param.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    for s in range(1, 41):
        assert rates[s] == pytest.approx(_vaswani(peak, warmup, s), rel=1e-12), s
    assert rates[warmup] == pytest.approx(peak, rel=1e-12) and max(rates) == pytest.approx(peak, rel=1e-12)
    assert rates[4 * warmup] == pytest.approx(peak / 2, rel=1e-12)
    assert rates[0] == pytest.approx(peak / warmup, rel=1e-12)  # the first update is not at rate 0


def test_warmup_0_keeps_the_peak_rate():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.Adam([param], lr=1e-3)
    scheduler = make_scheduler(optimizer, 0)
    for _ in range(5):
        param.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
        assert optimizer.param_groups[0]["lr"] == 1e-3


def test_the_loop_updates_with_the_scheduled_rate_of_each_step():
    """Update n (1-based) uses the rate after n - 1 schedule steps (the first one the rate of step 1)."""
    spec = _spec(warmup_steps=3, lr=2e-3)
    run = Run(spec).run(8)
    expected = [_vaswani(2e-3, 3, max(n - 1, 1)) for n in range(1, 9)]
    assert run.stage.lrs == pytest.approx(expected, rel=1e-12)
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(_vaswani(2e-3, 3, 8), rel=1e-12)


# ---- through the trainers (Multi30k slice) ----------------------------------------------------------------

@pytest.fixture(scope="module")
def prepared(multi30k, tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("engine")
    raw = use_tiny_data(tiny_spec_dict(multi30k, work), tiny_data)
    raw["train"] = {**raw["train"], "max_tokens": 128, "precision": "fp32", "log_every": 1, "keep_last": 0,
                    "stage_eval": False, "accumulate": 2, "checkpoint_every": 3}
    return raw, prepare_sweep_data(parse_spec(raw), progress=False)


def test_standalone_training_is_deterministic_and_trains_only_its_arch(prepared):
    raw, data = prepared
    spec = parse_spec(raw)
    arch = SearchSpace.from_spec(spec).narrowest()  # 1 of the 2 encoder layers
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = build_supernet(spec, data.vocab_size)
        start = copy.deepcopy(model.state_dict())
        losses = []
        result = train_standalone(model, arch, spec, data, 3,
                                  on_step=lambda step, loss, losses=losses: losses.append((step, loss)))
        runs.append((model, start, losses, result))
    (a, start, losses, result), (b, _, losses_b, _) = runs
    assert [s for s, _ in losses] == [1, 2, 3] and losses == losses_b
    assert all(math.isfinite(v) for _, v in losses)
    assert result["train_loss"] == pytest.approx(sum(v for _, v in losses) / 3)
    _assert_same_params(a, b)
    assert not a.training
    after = a.state_dict()
    assert all(torch.equal(after[n], start[n]) for n in start if n.startswith("encoder.1."))
    assert not torch.equal(after["encoder.0.attn.w_in"], start["encoder.0.attn.w_in"])


def test_a_supernet_run_killed_between_checkpoints_resumes_with_the_same_step_losses(prepared, tmp_path):
    """trainers.loop: checkpoint at step 3, killed after step 5, rerun: steps 4-7 again, each loss, gradient norm
    and rate equal to the uninterrupted run's (accumulate 2, sandwich_k 1, dropout and drop-branch on)."""
    raw, data = prepared
    spec = parse_spec({**raw, "train": {**raw["train"], "steps": 7}})
    keys = ("train_loss", "loss_narrowest", "loss_sampled", "grad_norm", "lr")

    def per_step(reports):
        return {r["step"]: tuple(r[k] for k in keys) for r in reports if "train_loss" in r and "stage" in r}

    straight = []
    train_supernet(spec, data, tmp_path / "straight", report=straight.append, progress=False)
    killed = []

    def kill_after_5(metrics):
        killed.append(metrics)
        if metrics.get("step") == 5:
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        train_supernet(spec, data, tmp_path / "killed", report=kill_after_5, progress=False)
    assert torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=True)["state"]["step"] == 3
    resumed = []
    train_supernet(spec, data, tmp_path / "killed", report=resumed.append, progress=False)
    want = per_step(straight)
    assert sorted(want) == list(range(1, 8))
    assert per_step(killed) == {s: want[s] for s in range(1, 6)}
    assert per_step(resumed) == {s: want[s] for s in range(4, 8)}


def test_a_supernet_run_with_cudas_deferred_checks_logs_what_a_checked_run_logs(prepared, tmp_path, monkeypatch):
    """trainers.loop with the CUDA path's loop settings on CPU: the same logged losses, norms and rates at the
    log steps, and the same checkpoint (its norms read before each checkpoint and log step)."""
    raw, data = prepared
    spec = parse_spec({**raw, "train": {**raw["train"], "steps": 7, "log_every": 2}})
    keys = ("train_loss", "loss_narrowest", "loss_sampled", "grad_norm", "lr")

    def run(folder):
        reports = []
        train_supernet(spec, data, tmp_path / folder, report=reports.append, progress=False)
        return {r["step"]: tuple(r[k] for k in keys) for r in reports if "train_loss" in r and "stage" in r}

    checked = run("checked")
    monkeypatch.setattr("trainers.loop.training_device", lambda device=None: DEFERRED)
    deferred = run("deferred")
    assert sorted(checked) == [2, 4, 6, 7] and deferred == checked
    a, b = (torch.load(tmp_path / f / "checkpoint.pt", weights_only=True) for f in ("checked", "deferred"))
    for name, p in a["model"].items():
        assert torch.equal(p, b["model"][name]), name
