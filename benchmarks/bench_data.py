"""The data path at WMT scale: preparation time and memory, a training process's memory, batches per second.

    python benchmarks/bench_data.py [--sizes 0.1M 1M 4.5M] [--old-sizes 0.1M 1M] [--work DIR] [--max-tokens 4096]

For each size, a synthetic parallel corpus is made from Multi30k's training pairs (en-de, 29k pairs, repeated,
each repetition in another shuffled order; plain text, ``--gzip`` for gzip) in ``--work`` (kept between runs:
corpora are reused), with Multi30k's validation files. Then, each in a fresh child process:

- **prepare**: ``prepare_data`` into an empty cache (vocabulary ``--vocab-size``, like
  ``search_spaces/multi30k_en_de.yaml``): wall time, peak RSS of the preparing process (``ru_maxrss``), of
  and peak PSS and RssAnon of its whole process tree, encoding workers included (``/proc`` polled every 0.1 s);
- **train**: what a training process does before and while it trains: open the prepared training split
  (``PreparedData.corpus``, memory-mapped), build its ``TokenBatcher`` (``--max-tokens``, seed 0), then
  collate batches (one epoch, at most ``--batches`` batches or ``--seconds`` s): RssAnon (anonymous memory,
  from ``/proc/self/status``: what the process owns, not the shared file pages) and VmRSS after the batcher
  is built, growth over the process's baseline (imports done), batches per second. One data-parallel rank
  does the same work (it collates the whole batch, then keeps rows ``rank::world``).

The same is measured for the code this replaced, at ``--old-sizes``: its ``prepare_data`` (the module
as of ``--old-rev``, read with ``git show``) and its training-process path (``load_split`` to Python lists,
the list batcher and the row-by-row ``collate``, transcribed below).

Prints one row per size and writes ``benchmarks/results/bench_data.json``. The goals (issue 16, a 2-core
machine): 4.5M pairs prepared with a peak RSS of at most 2 GB in no more than 103 s; a training process's
anonymous memory grows by at most 0.5 GB from 0.1M to 4.5M pairs; at least 500 batches/s per rank.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"
OLD_REV = "d0a84c7"
"""The last commit with the list-based data path (Parquet, ``load_split`` lists, the list batcher)."""


def parse_size(text: str) -> int:
    """``0.1M``, ``4.5M``, ``300k`` or ``12000`` -> pairs."""
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1].lower(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def label(pairs: int) -> str:
    return f"{pairs / 1e6:g}M" if pairs >= 100_000 else f"{pairs / 1e3:g}k"


# ---------------------------------------------------------------------------- corpora


def synthesize(pairs: int, work: Path, gz: bool) -> tuple[Path, Path]:
    """``pairs`` lines of Multi30k train.en / train.de, repeated, each repetition shuffled (seeded); reused."""
    folder = work / f"corpus-{label(pairs)}{'-gz' if gz else ''}"
    suffix = ".gz" if gz else ""
    src, tgt = folder / f"train.en{suffix}", folder / f"train.de{suffix}"
    if (folder / "DONE").is_file():
        return src, tgt
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    with gzip.open(MULTI30K / "train.en.gz", "rt", encoding="utf-8") as f:
        en = f.read().splitlines()
    with gzip.open(MULTI30K / "train.de.gz", "rt", encoding="utf-8") as f:
        de = f.read().splitlines()
    opener = (lambda p: gzip.open(p, "wt", encoding="utf-8", compresslevel=1)) if gz else \
        (lambda p: open(p, "w", encoding="utf-8"))
    written, rep = 0, 0
    with opener(src) as fs, opener(tgt) as ft:
        while written < pairs:
            order = list(range(len(en)))
            random.Random(rep).shuffle(order)
            take = order[: pairs - written]
            fs.write("".join(en[i] + "\n" for i in take))
            ft.write("".join(de[i] + "\n" for i in take))
            written += len(take)
            rep += 1
    (folder / "DONE").write_text(f"{pairs}\n")
    return src, tgt


# ---------------------------------------------------------------------------- child processes


def status_mib(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def load_old_module(path: Path):
    spec = importlib.util.spec_from_file_location("old_nas_data", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def child_prepare(args: argparse.Namespace) -> dict:
    if args.old_module:
        prepare = load_old_module(Path(args.old_module)).prepare_data
    else:
        from nas.data import prepare_data as prepare
    t0 = time.perf_counter()
    prepare(args.src, args.tgt, MULTI30K / "val.en.gz", MULTI30K / "val.de.gz", args.vocab_size, args.cache,
            progress=False)
    return {"seconds": time.perf_counter() - t0,
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


class OldBatcher:
    """The list batcher this replaced (``nas.data.TokenBatcher`` as of ``OLD_REV``), transcribed."""

    def __init__(self, src_ids, tgt_ids, max_tokens, *, shuffle=True, seed=0):
        self.src_ids, self.tgt_ids, self.max_tokens = src_ids, tgt_ids, max_tokens
        self.shuffle, self.seed = shuffle, seed
        order = list(range(len(src_ids)))
        if shuffle:
            random.Random(seed).shuffle(order)
        order = sorted(order, key=lambda i: (len(src_ids[i]), len(tgt_ids[i])))
        self._batches, current, longest = [], [], 0
        for i in order:
            length = max(len(src_ids[i]), len(tgt_ids[i])) + 1
            if current and (len(current) + 1) * max(longest, length) > max_tokens:
                self._batches.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, length)
        if current:
            self._batches.append(current)

    def __len__(self):
        return len(self._batches)

    def batches(self, epoch):
        import torch

        def pad(rows):
            out = torch.full((len(rows), max(map(len, rows))), 0, dtype=torch.int64)
            for i, row in enumerate(rows):
                out[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
            return out

        batches = [list(b) for b in self._batches]
        random.Random(f"{self.seed}:{epoch}").shuffle(batches)
        for idx in batches:
            src, tgt = [self.src_ids[i] for i in idx], [self.tgt_ids[i] for i in idx]
            tgt_out = pad([list(t) + [3] for t in tgt])
            yield (pad([list(s) + [3] for s in src]), pad([[2] + list(t) for t in tgt]), tgt_out,
                   int((tgt_out != 0).sum()))


def child_train(args: argparse.Namespace) -> dict:
    import torch  # noqa: F401  (a training process has it loaded)

    from nas.data import TokenBatcher, prepare_data

    data = prepare_data(args.src, args.tgt, MULTI30K / "val.en.gz", MULTI30K / "val.de.gz", args.vocab_size,
                        args.cache, progress=False)  # a finished cache entry: only opened
    base_anon, base_rss = status_mib("RssAnon"), status_mib("VmRSS")
    t0 = time.perf_counter()
    if args.old:
        src, tgt = data.load_split("train")
        batcher = OldBatcher(src, tgt, args.max_tokens, seed=0)
    else:
        batcher = TokenBatcher(data.corpus("train"), args.max_tokens, seed=0)
    build_s = time.perf_counter() - t0
    anon, rss = status_mib("RssAnon"), status_mib("VmRSS")
    count, t0 = 0, time.perf_counter()
    for _ in batcher.batches(0):
        count += 1
        if count >= args.batches or time.perf_counter() - t0 > args.seconds:
            break
    seconds = time.perf_counter() - t0
    return {"base_anon_mib": base_anon, "anon_mib": anon, "anon_growth_mib": anon - base_anon,
            "rss_mib": rss, "rss_growth_mib": rss - base_rss, "build_s": build_s, "batches": len(batcher),
            "collated": count, "batches_per_s": count / seconds, "anon_after_epoch_mib": status_mib("RssAnon"),
            "rss_after_epoch_mib": status_mib("VmRSS")}


# ---------------------------------------------------------------------------- the parent


def tree_memory_mib(pid: int) -> tuple[float, float]:
    """``(PSS, RssAnon)`` summed over ``pid`` and its descendants (MiB). PSS (``/proc/PID/smaps_rollup``) divides
    shared pages among their sharers, so the encoding workers' shared libraries count once; RssAnon leaves out
    file pages (mapped files, page cache), which the kernel can drop."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, frontier = {pid}, [pid]
    while frontier:
        children = [p for p, pp in parents.items() if pp in frontier and p not in tree]
        tree.update(children)
        frontier = children
    pss = anon = 0.0
    for p in tree:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                pss += next((int(line.split()[1]) for line in f if line.startswith("Pss:")), 0) / 1024
            with open(f"/proc/{p}/status") as f:
                anon += next((int(line.split()[1]) for line in f if line.startswith("RssAnon:")), 0) / 1024
        except OSError:
            pass
    return pss, anon


def run_child(mode: str, extra: list[str]) -> dict:
    """Run this script as a child in ``mode``; returns its JSON result plus ``tree_peak_mib`` and
    ``tree_peak_anon_mib`` (the peak PSS and RssAnon of its process tree, polled every 0.1 s)."""
    cmd = [sys.executable, __file__, "--child", mode, *extra]
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
    out.close()
    proc = subprocess.Popen([*cmd, "--result", out.name], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    peak = peak_anon = 0.0
    while proc.poll() is None:
        pss, anon = tree_memory_mib(proc.pid)
        peak, peak_anon = max(peak, pss), max(peak_anon, anon)
        time.sleep(0.1)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed with exit status {proc.returncode}")
    result = json.loads(Path(out.name).read_text())
    os.unlink(out.name)
    return {**result, "tree_peak_mib": peak, "tree_peak_anon_mib": peak_anon}


def old_module(work: Path, rev: str) -> Path | None:
    try:
        source = subprocess.run(["git", "show", f"{rev}:nas/data.py"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"old path skipped: cannot read nas/data.py at {rev} ({e})", file=sys.stderr)
        return None
    path = work / f"old_data_{rev}.py"
    path.write_text(source)
    return path


def measure(pairs: int, work: Path, args: argparse.Namespace, old: Path | None) -> dict:
    src, tgt = synthesize(pairs, work, args.gzip)
    common = ["--src", str(src), "--tgt", str(tgt), "--vocab-size", str(args.vocab_size)]
    row: dict = {"pairs": pairs, "size": label(pairs), "corpus_mib": (src.stat().st_size + tgt.stat().st_size) / 2**20}
    variants = [("new", None)] + ([("old", old)] if old is not None and pairs in args.old_sizes else [])
    for name, module in variants:
        cache = work / f"cache-{name}-{label(pairs)}"
        shutil.rmtree(cache, ignore_errors=True)
        extra = [*common, "--cache", str(cache)]
        print(f"[{label(pairs)}] {name}: preparing…", file=sys.stderr, flush=True)
        row[f"{name}_prepare"] = run_child("prepare", extra + (["--old-module", str(module)] if module else []))
        print(f"[{label(pairs)}] {name}: training process…", file=sys.stderr, flush=True)
        train_args = [*extra, "--max-tokens", str(args.max_tokens), "--batches", str(args.batches),
                      "--seconds", str(args.seconds)]
        if name == "old":  # the old process reads the old cache: lists from its parquet are the same ids
            train_args.append("--old")
            new_cache = work / f"cache-new-{label(pairs)}"
            train_args[train_args.index("--cache") + 1] = str(new_cache)
        row[f"{name}_train"] = run_child("train", train_args)
        if name == "old":
            shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(work / f"cache-new-{label(pairs)}", ignore_errors=True)
    return row


def fmt(row: dict, name: str, part: str, key: str, spec: str) -> str:
    value = row.get(f"{name}_{part}", {}).get(key)
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    head = ("| pairs | prepare s new / old | prepare peak MiB, process RSS / tree PSS / tree RssAnon: new | old "
            "| train RssAnon MiB (growth): new | old | train VmRSS MiB new | batcher build s new / old "
            "| batches/s new / old |")
    lines = [head, "|" + " --- |" * 9]
    for r in rows:
        lines.append(
            f"| {r['size']} | {fmt(r, 'new', 'prepare', 'seconds', '.1f')} "
            f"/ {fmt(r, 'old', 'prepare', 'seconds', '.1f')} "
            f"| {fmt(r, 'new', 'prepare', 'maxrss_mib', '.0f')} / {fmt(r, 'new', 'prepare', 'tree_peak_mib', '.0f')} "
            f"/ {fmt(r, 'new', 'prepare', 'tree_peak_anon_mib', '.0f')} "
            f"| {fmt(r, 'old', 'prepare', 'maxrss_mib', '.0f')} / {fmt(r, 'old', 'prepare', 'tree_peak_mib', '.0f')} "
            f"/ {fmt(r, 'old', 'prepare', 'tree_peak_anon_mib', '.0f')} "
            f"| {fmt(r, 'new', 'train', 'anon_mib', '.0f')} ({fmt(r, 'new', 'train', 'anon_growth_mib', '+.0f')}) "
            f"| {fmt(r, 'old', 'train', 'anon_mib', '.0f')} ({fmt(r, 'old', 'train', 'anon_growth_mib', '+.0f')}) "
            f"| {fmt(r, 'new', 'train', 'rss_mib', '.0f')} "
            f"| {fmt(r, 'new', 'train', 'build_s', '.2f')} / {fmt(r, 'old', 'train', 'build_s', '.2f')} "
            f"| {fmt(r, 'new', 'train', 'batches_per_s', '.0f')} / {fmt(r, 'old', 'train', 'batches_per_s', '.0f')} |")
    return "\n".join(lines)


def goals(rows: list[dict]) -> list[str]:
    by_size = {r["pairs"]: r for r in rows}
    out = []
    big = by_size.get(4_500_000)
    if big:
        p = big["new_prepare"]
        out.append(f"4.5M prepared in {p['seconds']:.1f} s (goal <= 103 s), peak RSS {p['maxrss_mib']:.0f} MiB in the "
                   f"preparing process; its tree with the workers: peak PSS {p['tree_peak_mib']:.0f} MiB, peak RssAnon "
                   f"{p['tree_peak_anon_mib']:.0f} MiB (goal <= 2048 MiB)")
    small = by_size.get(100_000)
    if big and small:
        grown = big["new_train"]["anon_mib"] - small["new_train"]["anon_mib"]
        out.append(f"training-process RssAnon 0.1M -> 4.5M: {grown:+.0f} MiB (goal <= +512 MiB)")
    for r in rows:
        out.append(f"{r['size']}: {r['new_train']['batches_per_s']:.0f} batches/s (goal >= 500)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["0.1M", "1M", "4.5M"], help="corpus sizes in pairs (0.1M, 300k...)")
    ap.add_argument("--old-sizes", nargs="*", default=["0.1M", "1M"], help="sizes that also measure the old path")
    ap.add_argument("--old-rev", default=OLD_REV, help="git revision of the old nas/data.py")
    ap.add_argument("--work", type=Path, default=None, help="folder for corpora and caches (default: a new temp one)")
    ap.add_argument("--gzip", action="store_true", help="write the corpora gzip-compressed")
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=5000, help="collate at most this many batches")
    ap.add_argument("--seconds", type=float, default=15.0, help="collate for at most this long")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "bench_data.json")
    ap.add_argument("--child", choices=("prepare", "train"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--tgt", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--old-module", help=argparse.SUPPRESS)
    ap.add_argument("--old", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = child_prepare(args) if args.child == "prepare" else child_train(args)
        Path(args.result).write_text(json.dumps(result))
        return
    args.old_sizes = {parse_size(s) for s in args.old_sizes}
    work = (args.work or Path(tempfile.mkdtemp(prefix="bench_data_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    old = old_module(work, args.old_rev) if args.old_sizes else None
    load = os.getloadavg()
    rows = [measure(parse_size(s), work, args, old) for s in args.sizes]
    text = table(rows)
    print(f"bench_data: {os.cpu_count()} CPUs, load average {load[0]:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end; max_tokens {args.max_tokens}, vocab {args.vocab_size}; "
          f"corpora in {work}")
    print(text)
    for line in goals(rows):
        print(line)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"command": " ".join(["python", "benchmarks/bench_data.py", *sys.argv[1:]]),
                                     "cpus": os.cpu_count(), "load_average_start": load[0],
                                     "load_average_end": os.getloadavg()[0], "max_tokens": args.max_tokens,
                                     "vocab_size": args.vocab_size, "rows": rows, "table": text,
                                     "goals": goals(rows)}, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
