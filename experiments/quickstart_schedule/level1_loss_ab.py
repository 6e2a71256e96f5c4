"""Level 1's candidate score (the validation loss on the first 100 sentences) before and after
``nas.eval.scores.target_nll``, interleaved in one process (issue 40 part 3): the old path (full ``[b, t, V]``
logits, log-softmax, gather) against the new (logits of the non-pad positions, ``logsumexp - z_y``), on a trained
quickstart supernet, 1 thread. Prints both losses of two archs (equal to float rounding) and the median time ratio.

    .venv/bin/python experiments/quickstart_schedule/level1_loss_ab.py DIR   # DIR: where the quickstart ran (its
                                                                             # nas_runs/ and search_spaces/)
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nas.builders import build_space, prepare_sweep_data  # noqa: E402
from nas.eval.scores import target_nll  # noqa: E402
from nas.model.losses import label_smoothed_nll  # noqa: E402
from nas.search.trials import load_supernet, validation_set  # noqa: E402
from nas.space import load_spec  # noqa: E402


def main() -> None:
    os.chdir(sys.argv[1])
    torch.set_num_threads(1)
    spec = load_spec("search_spaces/quickstart.yaml")
    data = prepare_sweep_data(spec, progress=False)
    model = load_supernet("nas_runs/quickstart/supernet").eval()
    space = build_space(spec)
    batches = list(validation_set(data, 100).loss_batches(4096, torch.device("cpu")))
    pad = statistics.fmean(float(b.tgt_out.eq(0).float().mean()) for b in batches)
    print(f"{len(batches)} batches {[tuple(b.tgt_out.shape) for b in batches]}, padding {pad:.0%} of their targets")
    rng = random.Random(0)
    archs = [space.sample(rng) for _ in range(8)]

    @torch.no_grad()
    def old(arch):
        return sum(float(label_smoothed_nll(model(b.src, b.tgt_in, arch), b.tgt_out, 0.0)[1]) for b in batches)

    @torch.no_grad()
    def new(arch):
        return sum(float(target_nll(model, b, arch)) for b in batches)

    for arch in archs[:2]:
        print(f"summed NLL old {old(arch):.4f} new {new(arch):.4f}")
    ratios = []
    for _ in range(3):
        for arch in archs:
            t = time.perf_counter()
            old(arch)
            t_old = time.perf_counter() - t
            t = time.perf_counter()
            new(arch)
            ratios.append((time.perf_counter() - t) / t_old)
    print(f"new / old time: median {statistics.median(ratios):.2f} over {len(ratios)} interleaved pairs")


if __name__ == "__main__":
    main()
