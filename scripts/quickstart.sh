#!/usr/bin/env bash
# The main job on the embedded defaults: sweep -> leaderboard -> export -> translate Multi30k test sentences.
# At the end it prints each stage's seconds, read from the sweep's own lines as they came (exported/sweep.log
# holds them, each prefixed with its epoch second) and from the times taken around the commands below.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
# glibc gives each block over 32 MB (a step's logits: 4,096 x 6,000 floats) its own mmap and unmaps it when freed,
# so every forward pass faulted fresh zeroed pages in. Keeping freed memory for reuse made a supernet step
# 0.74-0.77x and a level-1 candidate 0.63-0.79x as long on a 2-core CPU, the weights bit-for-bit equal
# (benchmarks/bench_sandwich_step.py --allocators). glibc's own variables, not GLIBC_TUNABLES: Ray starts its
# workers with GLIBC_TUNABLES cut at its first ':' (read in /proc/<pid>/environ), which left trimming on in every
# trial; these two reach the workers whole.
export MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000
mkdir -p exported
: > exported/sweep.log
start=$(date +%s)
# Each line of the sweep printed at once and kept with the second it came (bash's printf %()T: no process per
# line); unbuffered, so that a line's time is when it was written.
PYTHONUNBUFFERED=1 nas sweep search_spaces/quickstart.yaml 2>&1 \
  | while IFS= read -r line; do printf '%s\n' "$line"; printf '%(%s)T %s\n' -1 "$line" >> exported/sweep.log; done
swept=$(date +%s)
nas leaderboard --experiment quickstart --top 10 --format csv --out exported/leaderboard.csv  # the sweep printed the table
nas export --best --experiment quickstart --out exported/quickstart
exported=$(date +%s)
zcat ../shared/data/multi30k/test_2016_flickr.en.gz > exported/test_2016_flickr.en
nas translate exported/quickstart < exported/test_2016_flickr.en > exported/test_2016_flickr.hyp.de
sacrebleu <(zcat ../shared/data/multi30k/test_2016_flickr.de.gz) -i exported/test_2016_flickr.hyp.de -m bleu chrf -b -w 2 \
  | paste -sd' ' | sed 's/^/test_2016_flickr BLEU chrF of the exported model: /'
done_s=$(date +%s)
echo "quickstart wall time: $(( done_s - start )) s (after setup)"
# A stage runs from its first line to the next stage's (a stage the sweep skipped, e.g. a reused supernet: 0 s).
awk -v start="$start" -v swept="$swept" -v exported="$exported" -v done_s="$done_s" '
  function mark(i, re) { if (!(i in t) && $0 ~ ("^[0-9]+ " re)) t[i] = $1 }
  { mark(1, "(training|reusing) the (trained )?supernet"); mark(2, "level 1: timing ")
    mark(3, "level 1: [0-9]+ x [0-9]+ candidates"); mark(4, "searching") }
  END {
    t[0] = start; t[5] = swept; t[6] = exported; t[7] = done_s
    for (i = 1; i <= 4; i++) if (!(i in t)) t[i] = t[i - 1]
    for (i = 3; i >= 1; i--) if (t[i] > t[i + 1]) t[i] = t[i + 1]
    split("data|supernet|predictor samples|level 1|level 2|leaderboard, export|translate, score", name, "|")
    print "stage seconds (after setup):"
    for (i = 1; i <= 7; i++) printf "  %-20s %6d\n", name[i], t[i] - t[i - 1]
  }' exported/sweep.log
