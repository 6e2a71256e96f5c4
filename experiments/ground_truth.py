"""Ground truth for ``search_spaces/quickstart_depth.yaml``: archs of the space trained alone with Transformer-Tiny's
recipe, so that "the search missed" can be told apart from "the space holds nothing better".

Phases (``--phase``, in this order):

- ``plan``: the archs and the recipe. The 3 baselines (Tiny-S 2+2, Transformer-Tiny 4+4 with 2 seeds, Tiny-L 6+6),
  :data:`DEEP` (deep encoder, shallow decoder: 5-6 encoder layers, 1-2 decoder layers, across the widths, FFN widths
  and branches) and :data:`UNIFORM` archs drawn uniformly from the space with seed :data:`SEED`. Writes
  ``experiments/ground_truth/plan.json`` (committed) and ``.gtgpu/`` (ignored by git: the YAML, the data and its
  cache), which travels to the GPU machine for ``experiments/ground_truth_gpu.py``.
- ``collect --results F``: split the GPU's ``results.json`` into one JSON per arch under
  ``experiments/ground_truth/archs/`` and add the paper-comparable BLEU of the test hypotheses
  (:func:`nas.eval.scores.paper_bleu`).
- ``latency``: time every arch on this CPU with the YAML's fixed workload, one thread, interleaved with
  Transformer-Tiny (:func:`nas.eval.latency.measure_latency_ratio`), fresh weights (latency is a function of the arch
  and the device); adds ``latency_ms`` and ``latency_ratio`` to each arch's JSON. Run it with nothing else running.

**The recipe** (:data:`RECIPE`) is Wu et al.'s (ACL 2021, LividWo/Revisit-MMT ``README-baseline.md`` and fairseq's
defaults): lr 0.005, inverse-square-root warm-up from 1e-7, 8,192 tokens per update (one batch here: one GPU holds
it), no gradient clipping, dropout 0.3, label smoothing 0.1, Adam (0.9, 0.98), the last 10 epochs averaged (a snapshot
every 62 updates, one epoch of Multi30k at 8,192 padded tokens), beam 5, length penalty 1. **Departures** (the
device time of a session): the run is :data:`STEPS` updates, not 8,000, and the warm-up is scaled with it (a quarter
of the run, as 2,000 of 8,000 is); it stays pre-norm with a SentencePiece vocabulary on raw text. The GPU run may
lower the step count further, the same for every arch (``steps_target`` in each JSON).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

YAML = ROOT / "search_spaces" / "quickstart_depth.yaml"
DATA = ROOT.parent / "shared" / "data" / "multi30k"
TEST = ("test_2016_flickr.en.gz", "test_2016_flickr.de.gz")
OUT = ROOT / "experiments" / "ground_truth"
CARRY = ROOT / ".gtgpu"
"""What travels to the GPU machine (ignored by git): plan, YAML, data and the data cache."""
SEED = 2026
UNIFORM = 20
EPOCH_UPDATES = 62
"""Updates of 8,192 padded tokens in one epoch of Multi30k (29,000 pairs x 17.6 padded tokens)."""
STEPS = 32 * EPOCH_UPDATES
"""Updates of the GPU run (1,984): what 32 archs reach in about 5 minutes of one H200 shared by 33 processes."""
RECIPE: dict[str, Any] = {
    "steps": STEPS, "lr": 0.005, "warmup_steps": STEPS // 4, "warmup_init_lr": 1e-7, "clip_norm": 0.0,
    "accumulate": 1, "max_tokens": 8192, "dropout": 0.3, "label_smoothing": 0.1, "drop_branch": 0.0,
    "average_last": 10, "checkpoint_every": EPOCH_UPDATES, "beam_size": 5, "length_penalty": 1.0}
BASELINES: dict[str, tuple[int, int, int, tuple[int, ...]]] = {
    # key: (layers per stack, width, FFN width, seeds); one branch
    "tiny_s": (2, 128, 256, (0,)),
    "tiny": (4, 128, 256, (0, 1)),
    "tiny_l": (6, 128, 512, (0,)),
}
DEEP: tuple[tuple[str, str], ...] = (
    # (encoder, decoder): per layer "width/ffn" with "x2" for two branches
    ("128/512 " * 6, "128/512"),
    ("128/512 " * 6, "128/512 128/512"),
    ("128/512x2 " * 6, "128/512 128/512"),
    ("128/512x2 " * 6, "128/256"),
    ("128/256 " * 5, "128/256 128/256"),
    ("128/512x2 " * 5, "64/256"),
    ("64/512 " * 6, "128/512 128/512"),
    ("128/512x2 " * 5, "128/512x2 128/512x2"),
    ("128/256x2 " * 6, "64/512 64/512"),
)
SUPERNET = {"steps": 6000, "checkpoint_every": 250, "keep_steps": [500, 1000, 2000, 4000]}
"""The ``quickstart_depth`` supernet trained beside the ground truth (issue "The search finds what the space holds",
part 1): its YAML's recipe, ``train.steps`` raised; fp16 weights come back at these steps and at the last."""


def _stack(text: str):
    from nas.space.arch import StackArch

    layers = text.split()
    width, ffn, branches = [], [], []
    for layer in layers:
        wf, _, b = layer.partition("x")
        w, f = wf.split("/")
        width.append(int(w))
        ffn.append(int(f))
        branches.append(int(b or 1))
    return StackArch(width=tuple(width), ffn_width=tuple(ffn), branches=tuple(branches))


def baseline_arch(key: str):
    """The hand-designed Transformer ``key`` of :data:`BASELINES` (uniform layers, one branch)."""
    from nas.space.arch import Arch, StackArch

    layers, width, ffn, _ = BASELINES[key]
    stack = StackArch(width=(width,) * layers, ffn_width=(ffn,) * layers, branches=(1,) * layers)
    return Arch(encoder=stack, decoder=stack)


def plan_models(spec) -> list[dict[str, Any]]:
    """The plan's models in order: baselines (by seed), :data:`DEEP`, then :data:`UNIFORM` distinct uniform draws
    (seed :data:`SEED`) that are neither a baseline nor a deep arch."""
    from nas.builders import build_space
    from nas.space.arch import Arch

    models: list[dict[str, Any]] = []
    seen: set[str] = set()

    def add(key: str, kind: str, arch, seed: int = 0) -> None:
        models.append({"key": key, "kind": kind, "seed": seed, "arch": arch.to_dict(), "arch_id": arch.arch_id,
                       "arch_summary": arch.summary()})
        seen.add(arch.arch_id)

    for name, (*_, seeds) in BASELINES.items():
        for s in seeds:
            add(f"baseline_{name}_seed{s}", "baseline", baseline_arch(name), s)
    for i, (enc, dec) in enumerate(DEEP):
        add(f"deep_{i:02d}", "deep", Arch(encoder=_stack(enc), decoder=_stack(dec)))
    space, rng = build_space(spec), random.Random(SEED)
    i = 0
    while i < UNIFORM:
        arch = space.sample(rng)
        if arch.arch_id in seen:
            continue
        add(f"uniform_{i:02d}", "uniform", arch)
        i += 1
    return models


def phase_plan(smoke: bool) -> None:
    """Write ``plan.json`` and the folder that travels (:data:`CARRY`)."""
    import yaml

    from nas.builders import prepare_sweep_data
    from nas.space import load_spec

    spec = load_spec(YAML)
    data = prepare_sweep_data(spec, progress=False)
    models = plan_models(spec)
    if CARRY.exists():
        shutil.rmtree(CARRY)  # ours: written only by this phase (ignored by git)
    (CARRY / "data").mkdir(parents=True)
    for name in ("train.en.gz", "train.de.gz", "val.en.gz", "val.de.gz", *TEST):
        shutil.copyfile(DATA / name, CARRY / "data" / name)
    raw = yaml.safe_load(YAML.read_text(encoding="utf-8"))
    for split, (src, tgt) in {"train": ("train.en.gz", "train.de.gz"), "valid": ("val.en.gz", "val.de.gz")}.items():
        raw["data"][split] = {"src": f".gtgpu/data/{src}", "tgt": f".gtgpu/data/{tgt}"}
    raw["data"]["cache_dir"] = ".gtgpu/cache"
    raw["workdir"] = ".gtgpu/runs"
    (CARRY / "sweep.yaml").write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    shutil.copytree(Path(spec.data.cache_dir), CARRY / "cache")
    recipe = dict(RECIPE)
    supernet = {**SUPERNET, "yaml": ".gtgpu/sweep.yaml"}
    if smoke:  # the CPU dry run: a few steps of everything
        recipe.update({"steps": 8, "warmup_steps": 2, "checkpoint_every": 2, "max_tokens": 1024})
        supernet.update({"steps": 6, "checkpoint_every": 2, "keep_steps": [2, 4]})
    plan = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "yaml": ".gtgpu/sweep.yaml",
            "test": [f".gtgpu/data/{n}" for n in TEST], "recipe": recipe, "keep_snapshots": 40,
            "supernet": supernet, "smoke": smoke, "vocab_size": data.vocab_size, "models": models}
    (CARRY / "plan.json").write_text(json.dumps(plan, indent=2), encoding="utf-8")
    if not smoke:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "plan.json").write_text(json.dumps(plan, indent=2) + "\n", encoding="utf-8")
    kinds = {k: sum(m["kind"] == k for m in models) for k in ("baseline", "deep", "uniform")}
    print(f"plan: {len(models)} models {kinds}, {recipe['steps']} steps; {CARRY}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", required=True, choices=("plan",))
    ap.add_argument("--smoke", action="store_true", help="a plan of a few steps, for a dry run on the CPU")
    args = ap.parse_args(argv)
    if args.phase == "plan":
        phase_plan(args.smoke)


if __name__ == "__main__":
    main()
