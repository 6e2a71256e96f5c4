"""A level-2 trial's scoring (beam-4 BLEU and the validation loss, 1 thread: ``search.cpu_per_trial``) on the first
500 validation sentences against all 1,014: three archs of a finished quickstart sweep, each scored both ways twice,
the order flipped in the second round, nothing else running. Prints the seconds and the ratio of their sums.

    python experiments/quickstart_schedule/level2_subset_time.py --sweep-dir nas_runs/quickstart \
        --data nas_runs/data/<hash>
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ARCHS = ["enc[128/512 128/512x2 128/256x2] dec[128/512 128/512]", "enc[128/256 128/256] dec[64/256 64/256]",
         "enc[64/512 128/512x2] dec[128/512 128/512]"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep-dir", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--sentences", type=int, default=500)
    args = ap.parse_args()

    import torch

    from nas.data import PreparedData
    from nas.eval.validation import ValidationSet, validation_scores
    from nas.model.io import load_model
    from nas.space.arch import Arch

    torch.set_num_threads(1)
    data = PreparedData.open(args.data.resolve())
    model = load_model(args.sweep_dir / "supernet", "supernet").eval()
    sets = {str(args.sentences): ValidationSet.load(data, args.sentences), "all": ValidationSet.load(data, None)}
    archs = [Arch.parse(s) for s in ARCHS]
    seconds: dict[str, list[float]] = {name: [] for name in sets}
    for rep in range(2):
        for arch in archs:
            for name in (list(sets) if rep == 0 else list(sets)[::-1]):
                start = time.perf_counter()
                validation_scores(model, arch, sets[name], beam_size=4, loss=True, max_tokens=4096)
                seconds[name].append(time.perf_counter() - start)
    print({name: [round(s, 1) for s in v] for name, v in seconds.items()})
    first, whole = (sum(v) for v in seconds.values())
    print(f"ratio of sums {args.sentences}/all: {first / whole:.3f}")


if __name__ == "__main__":
    main()
