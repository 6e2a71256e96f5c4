#!/usr/bin/env bash
# The main job on the embedded defaults: sweep -> leaderboard -> export -> translate Multi30k test sentences.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
start=$(date +%s)
nas sweep search_spaces/quickstart.yaml
nas leaderboard --experiment quickstart --top 10 --format csv --out exported/leaderboard.csv  # the sweep printed the table
nas export --best --experiment quickstart --out exported/quickstart
zcat ../shared/data/multi30k/test_2016_flickr.en.gz > exported/test_2016_flickr.en
nas translate exported/quickstart < exported/test_2016_flickr.en > exported/test_2016_flickr.hyp.de
sacrebleu <(zcat ../shared/data/multi30k/test_2016_flickr.de.gz) -i exported/test_2016_flickr.hyp.de -m bleu chrf -b -w 2 \
  | paste -sd' ' | sed 's/^/test_2016_flickr BLEU chrF of the exported model: /'
echo "quickstart wall time: $(( $(date +%s) - start )) s (after setup)"
