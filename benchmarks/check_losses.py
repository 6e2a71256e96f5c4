"""Print the first N fp32 training losses of the quickstart supernet as JSON (a refactor's regression check).

    python benchmarks/check_losses.py --steps 50 --out losses.json

Run it on two checkouts (``PYTHONPATH=<checkout>``) and compare the files: a change that keeps the
training computation must give the same losses (issue 13 asks for 1e-6). Each step's
``loss_widest``, ``loss_narrowest`` and ``loss_sampled`` are logged (``train.log_every: 1``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports():
    try:  # the builder layer (after issue 13)
        from nas.builders import prepare_sweep_data
        from nas.space import load_spec
        from trainers import train_supernet
    except ImportError:  # before it
        from nas.builders import prepare_sweep_data
        from nas.space.spec import load_spec
        from trainers import train_supernet
    return load_spec, prepare_sweep_data, train_supernet


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(ROOT / "search_spaces" / "quickstart.yaml"))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "nas_check_losses_data"))
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args(argv)
    load_spec, prepare_sweep_data, train_supernet = _imports()
    spec = load_spec(args.spec)
    spec = spec.model_copy(update={
        "train": spec.train.model_copy(update={"steps": args.steps, "log_every": 1, "precision": "fp32",
                                               "stage_eval": False, "checkpoint_every": 10 ** 6}),
        "data": spec.data.model_copy(update={"cache_dir": Path(args.cache_dir)}),
    })
    data = prepare_sweep_data(spec, progress=False)
    losses: list[dict[str, float]] = []
    keys = ("loss_widest", "loss_narrowest", "loss_sampled")

    def report(metrics: dict) -> None:
        if "loss_widest" in metrics and not metrics.get("stage_end") and len(losses) < args.steps:
            losses.append({k: float(metrics[k]) for k in keys if k in metrics})

    with tempfile.TemporaryDirectory() as out:
        train_supernet(spec, data, out, report=report, progress=False)
    text = json.dumps(losses, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text if not args.out else f"{len(losses)} steps -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
