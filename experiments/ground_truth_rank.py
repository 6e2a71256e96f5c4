"""The supernet's ranking of the ground-truth archs: the inherited validation loss of every arch of
``experiments/ground_truth/archs/`` inside the space, from each snapshot of the ``quickstart_depth`` supernet that
``experiments/ground_truth_gpu.py`` trained beside the ground truth (fp16 ``supernet_stepNNNNNN.safetensors``).

    python experiments/ground_truth_rank.py --snapshots DIR

writes ``experiments/ground_truth/supernet_ranking.json``: ``{"metric", "snapshots": {step: {"by_arch_id": {arch_id:
loss}, "level1": {score: {arch_id: value}}}}, "notes"}``; ``experiments/ground_truth.py --phase report`` turns it into Kendall tau and top-5 recall. The
loss is the level-1 screening score of a two-level search (teacher-forced negative log-likelihood per target token,
nats, no label smoothing, the whole validation set), computed on this CPU in fp32 from the fp16 weights. An arch
outside the space (Tiny-L's 6-layer decoder; the space has at most 4) has no inherited score and is left out.

Beside it (``level1``), the two scores level 1 can rank by (``search.evolution.score``) as a sweep of the YAML computes
them, on the first ``search.evolution.subset_sentences`` (200) validation sentences: ``valid_loss`` and
``greedy_bleu`` (maximized), so the report can say which of them ranks closest to the ground truth.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARCHS = ROOT / "experiments" / "ground_truth" / "archs"
OUT = ROOT / "experiments" / "ground_truth" / "supernet_ranking.json"
YAML = ROOT / "search_spaces" / "quickstart_depth.yaml"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--snapshots", type=Path, required=True, help="folder of supernet_stepNNNNNN.safetensors")
    args = ap.parse_args(argv)

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from nas.builders import build_space, prepare_sweep_data
    from nas.eval.validation import ValidationSet, validation_scores
    from nas.model.supernet import SuperTransformer
    from nas.space import load_spec
    from nas.search.trials import validation_set
    from nas.space.arch import Arch

    torch.set_num_threads(1)
    spec = load_spec(YAML)
    data = prepare_sweep_data(spec, progress=False)
    space = build_space(spec)
    vset = ValidationSet.load(data)
    subset = validation_set(data, spec.search.evolution.subset_sentences)
    archs: dict[str, Arch] = {}
    outside: set[str] = set()
    for path in sorted(ARCHS.glob("*.json")):
        row = json.loads(path.read_text(encoding="utf-8"))
        arch = Arch.from_dict(row["arch"])
        try:
            problem = space.check_params(space.params_of(arch))
        except (ValueError, KeyError, IndexError) as e:
            problem = str(e)
        if problem:
            outside.add(f"{row['key']} ({problem})")
            continue
        archs[row["arch_id"]] = arch
    result = json.loads(OUT.read_text(encoding="utf-8")) if OUT.is_file() else {"snapshots": {}}
    for snap in sorted(args.snapshots.glob("supernet_step*.safetensors")):
        step = str(int(snap.stem.removeprefix("supernet_step")))
        done = result["snapshots"].get(step, {}).get("by_arch_id", {})
        level1 = result["snapshots"].get(step, {}).get("level1", {})
        if set(archs) <= set(done) and all(set(archs) <= set(level1.get(k, {})) for k in ("valid_loss", "greedy_bleu")):
            continue
        with safe_open(str(snap), "pt") as f:
            config = json.loads(f.metadata()["config"])
        model = SuperTransformer.from_config(config)
        model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in load_file(str(snap)).items()})
        model.eval()
        losses = dict(done)
        for arch_id, arch in sorted(archs.items()):
            if arch_id not in losses:
                losses[arch_id] = validation_scores(model, arch, vset, beam_size=None, loss=True)["valid_loss"]
        level1 = {k: dict(level1.get(k, {})) for k in ("valid_loss", "greedy_bleu")}
        for arch_id, arch in sorted(archs.items()):
            if arch_id not in level1["valid_loss"]:
                level1["valid_loss"][arch_id] = validation_scores(model, arch, subset, beam_size=None, loss=True,
                                                                  max_tokens=spec.train.max_tokens)["valid_loss"]
            if arch_id not in level1["greedy_bleu"]:
                level1["greedy_bleu"][arch_id] = validation_scores(model, arch, subset, beam_size=1, loss=False)["bleu"]
        result["snapshots"][step] = {"by_arch_id": losses, "level1": level1}
        print(f"step {step}: {len(losses)} archs, loss {min(losses.values()):.3f}-{max(losses.values()):.3f}",
              file=sys.stderr, flush=True)
        result.update({"metric": "inherited valid loss", "notes": (
            "quickstart_depth supernet (its YAML's train: section, train.steps raised to 6000) trained on one H200 "
            "beside the ground truth until the run's deadline (1,250 sandwich steps); inherited validation loss "
            "(nats per target token, no label smoothing, fp16 weights evaluated in fp32 on the CPU). Outside the "
            "space, no score: " + "; ".join(sorted(outside)))})
        tmp = OUT.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(OUT)


if __name__ == "__main__":
    main()
