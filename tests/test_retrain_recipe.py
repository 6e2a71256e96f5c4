"""Transformer-Tiny's published recipe in `nas retrain` (issue 38; Wu et al. ACL 2021, fairseq: lr 0.005,
``inverse_sqrt`` warm-up of 2,000 updates from ``--warmup-init-lr 1e-7``, 8,192 tokens per update, no clipping,
beam 5, length penalty 1): the schedule against a transcription of fairseq's, clipping switched off by 0, the YAML
keys and their checks, and `nas retrain` handing each of them to the code that uses it."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from typer.testing import CliRunner

from nas.space import SpecError, parse_spec
from tests.conftest import tiny_spec_dict, use_tiny_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY_RECIPE = {"lr": 0.005, "warmup_steps": 2000, "warmup_init_lr": 1e-7, "clip_norm": 0, "max_tokens": 4096,
               "accumulate": 2, "beam_size": 5, "length_penalty": 1.0}
"""Transformer-Tiny's fairseq flags as ``retrain:`` keys (``--max-tokens 4096 --update-freq 2``: 8,192 tokens)."""


def _raw(tmp_path, **retrain) -> dict:
    raw = tiny_spec_dict(tmp_path / "data", tmp_path)  # parse_spec reads no file
    raw["retrain"] = retrain
    return raw


# ---- the schedule ------------------------------------------------------------------------------------------

def fairseq_inverse_sqrt(lr: float, warmup_updates: int, warmup_init_lr: float, updates: int) -> list[float]:
    """The learning rate of each of the first ``updates`` updates under fairseq's ``inverse_sqrt`` scheduler
    (``fairseq/optim/lr_scheduler/inverse_square_root_schedule.py``), transcribed as a loop: ``__init__`` sets
    ``warmup_init_lr``; after each update the trainer calls ``step_update(num_updates)`` with the updates done so
    far, which sets the rate of the next one."""
    lr_step = (lr - warmup_init_lr) / warmup_updates
    decay_factor = lr * warmup_updates ** 0.5
    current, rates = warmup_init_lr, []
    for done in range(updates):
        rates.append(current)  # update done + 1 runs at the rate set when `done` updates were done
        num_updates = done + 1
        current = (warmup_init_lr + num_updates * lr_step if num_updates < warmup_updates
                   else decay_factor * num_updates ** -0.5)
    return rates


def test_inverse_sqrt_lr_with_an_initial_rate_is_fairseq_s_schedule_update_for_update():
    """Our ``step`` counts the optimizer steps done before the one it sets the rate of, from 0: it is fairseq's
    ``num_updates`` when that update runs (no off-by-one): update 1 at ``warmup_init_lr``, update 2001 at the peak."""
    from trainers.optim import inverse_sqrt_lr

    lr, warmup, init = TINY_RECIPE["lr"], TINY_RECIPE["warmup_steps"], TINY_RECIPE["warmup_init_lr"]
    factor = inverse_sqrt_lr(warmup, init / lr)
    expected = fairseq_inverse_sqrt(lr, warmup, init, 3 * warmup)
    got = [lr * factor(step) for step in range(3 * warmup)]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-18)
    assert got[0] == pytest.approx(1e-7) and got[warmup - 1] < lr and got[warmup] == pytest.approx(lr)
    assert got[-1] == pytest.approx(lr * math.sqrt(warmup / (3 * warmup - 1)))


def test_make_scheduler_gives_each_optimizer_step_fairseq_s_rate():
    """The rate Adam steps with, read before each :func:`trainers.engine.optimizer_step`-style step (optimizer,
    then schedule), over a short warm-up and past it."""
    from trainers.optim import make_scheduler

    lr, warmup, init = 0.005, 4, 1e-7
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([weight], lr=lr)
    scheduler = make_scheduler(optimizer, warmup, init_ratio=init / lr)
    used = []
    for _ in range(12):
        used.append(optimizer.param_groups[0]["lr"])
        weight.grad = torch.ones(1)
        optimizer.step()
        scheduler.step()
    assert used == pytest.approx(fairseq_inverse_sqrt(lr, warmup, init, 12), rel=1e-12, abs=1e-18)


# ---- clipping ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("clip_norm", "clipped"), [(0, False), (1.0, True)], ids=["off", "one"])
def test_train_clip_norm_0_leaves_a_large_gradient_as_it_is_and_1_clips_it(tmp_path, clip_norm, clipped):
    from nas.builders import build_supernet
    from trainers.engine import optimizer_step
    from trainers.optim import make_optimizer, make_scheduler

    spec = parse_spec({**_raw(tmp_path), "train": {**_raw(tmp_path)["train"], "clip_norm": clip_norm}})
    assert spec.train.clip_norm == clip_norm
    torch.manual_seed(0)
    model = build_supernet(spec, 50)
    optimizer = make_optimizer(model, 1e-3, 0.0)
    scheduler = make_scheduler(optimizer, 4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)  # a global norm of 3 * sqrt(parameters): far above 1
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = math.sqrt(sum(9.0 * p.numel() for p in model.parameters()))

    reported = optimizer_step(model, optimizer, scheduler, spec.train.clip_norm, "step 1")
    assert float(reported) == pytest.approx(norm, rel=1e-5)  # the norm before clipping, either way
    after = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))
    assert after == pytest.approx(1.0 if clipped else norm, rel=1e-4)
    if not clipped:
        assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters())


def test_a_negative_clip_norm_or_initial_rate_in_train_is_refused_naming_the_key(tmp_path):
    raw = _raw(tmp_path)
    with pytest.raises(SpecError, match="train.clip_norm"):
        parse_spec({**raw, "train": {**raw["train"], "clip_norm": -1}})
    with pytest.raises(SpecError, match="train.warmup_init_lr"):
        parse_spec({**raw, "train": {**raw["train"], "warmup_init_lr": -1e-7}})


# ---- the YAML keys -----------------------------------------------------------------------------------------

def test_the_tiny_recipe_validates_and_resolves_to_its_values_and_the_training_spec_carries_them(tmp_path):
    spec = parse_spec(_raw(tmp_path, **TINY_RECIPE))
    recipe = spec.retrain.resolved(spec)
    assert {k: recipe[k] for k in TINY_RECIPE} == TINY_RECIPE
    train = spec.retrain.training_spec(spec).train  # what train_standalone reads
    assert (train.lr, train.warmup_steps, train.warmup_init_lr, train.clip_norm, train.max_tokens,
            train.accumulate) == (0.005, 2000, 1e-7, 0, 4096, 2)
    json.dumps(recipe)  # logged as MLflow params and written to retrain.json


def test_left_out_the_new_keys_take_the_training_and_search_values_and_fairseq_s_length_penalty(tmp_path):
    raw = _raw(tmp_path)
    raw["train"] = {**raw["train"], "clip_norm": 0.5, "warmup_init_lr": 1e-6, "accumulate": 3}
    spec = parse_spec(raw)
    recipe = spec.retrain.resolved(spec)
    assert (recipe["clip_norm"], recipe["warmup_init_lr"], recipe["accumulate"]) == (0.5, 1e-6, 3)
    assert (recipe["beam_size"], recipe["length_penalty"]) == (spec.search.beam_size, 1.0)


@pytest.mark.parametrize(("key", "value"), [("clip_norm", -1), ("accumulate", 0), ("warmup_init_lr", -1e-7),
                                            ("beam_size", 0), ("length_penalty", -0.5)])
def test_a_bad_recipe_value_is_refused_naming_the_key(tmp_path, key, value):
    with pytest.raises(SpecError, match=f"retrain.{key}"):
        parse_spec(_raw(tmp_path, **{**TINY_RECIPE, key: value}))


# ---- nas retrain ------------------------------------------------------------------------------------------

def test_nas_retrain_trains_and_scores_with_the_recipe_and_prints_the_paper_bleu(multi30k, tiny_data, tmp_path,
                                                                               mlflow_uri, monkeypatch):
    """Spies on the calls `nas retrain` makes (each delegating to the real one): the loop gets the accumulation
    and clipping, the schedule the initial rate, beam search the beams and the length penalty, the paper BLEU
    the target language of ``data.valid.tgt`` (``val.de.gz``); the run logs and prints ``bleu_paper``."""
    import nas.eval.validation as validation
    import trainers.standalone_trainer as standalone
    from nas import tracking
    from nas.cli import app
    from nas.eval.scores import PAPER_BLEU_LABEL

    raw = use_tiny_data(tiny_spec_dict(multi30k, tmp_path), tiny_data)
    raw["retrain"] = {**TINY_RECIPE, "steps": 2, "warmup_steps": 2, "max_tokens": 256, "checkpoint_every": 2,
                      "beam_size": 3, "length_penalty": 0.6}
    raw["search"] = {**raw["search"], "latency_repeats": 2}
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(f"# nas sweep {spec_file.name}\n" + yaml.safe_dump(raw))
    seen: dict[str, list] = {"loop": [], "schedule": [], "beam": [], "paper": []}

    def spy(name, real, record):
        def wrapper(*args, **kwargs):
            seen[name].append(record(*args, **kwargs))
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(standalone, "run_loop", spy("loop", standalone.run_loop,
                                                    lambda *a, **k: (k["accumulate"], k["clip_norm"])))
    monkeypatch.setattr(standalone, "make_scheduler", spy("schedule", standalone.make_scheduler,
                                                          lambda opt, warmup, **k: (warmup, k["init_ratio"])))
    monkeypatch.setattr(validation, "beam_search", spy("beam", validation.beam_search,
                                                       lambda *a, **k: (k["beam_size"], k["len_penalty"])))
    monkeypatch.setattr(validation, "paper_bleu", spy("paper", validation.paper_bleu, lambda h, r, lang: lang))

    result = CliRunner().invoke(app, ["retrain", str(spec_file), "--arch", "enc[32/64] dec[32/64]",
                                      "--out", str(tmp_path / "rt")])
    assert result.exit_code == 0, (result.output, result.exception)
    assert seen["loop"] == [(2, 0)]
    assert seen["schedule"] == [(2, pytest.approx(1e-7 / 0.005))]
    assert seen["beam"] and set(seen["beam"]) == {(3, 0.6)}
    assert seen["paper"] == ["de"]
    metrics = json.loads((tmp_path / "rt" / "metrics.json").read_text())
    assert 0.0 <= metrics["bleu_paper"] <= 100.0
    (run,) = tracking.find_runs("tiny", role="retrain")
    assert run.data.metrics["bleu_paper"] == pytest.approx(metrics["bleu_paper"])
    assert run.data.params["retrain.length_penalty"] == "0.6" and run.data.params["retrain.clip_norm"] == "0.0"
    line = " ".join(result.stdout.split())
    assert f"{PAPER_BLEU_LABEL} {metrics['bleu_paper']:.2f}" in line, line
    assert f"sacreBLEU {metrics['bleu']:.2f}" in line and "beam 3, length penalty 0.6" in line, line
