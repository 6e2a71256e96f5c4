"""nas.search.tune.save_stopped_trials: a trial whose Ray worker died is ERROR in the experiment state on disk, as
Ray Tune's loop saw it, and a restored experiment does not run it again.

One subprocess (a local one-CPU Ray cluster, real Ray Tune) runs two experiments of one trial each, whose trainable
SIGKILLs its own worker after 1.5 s on each of its two attempts (``max_failures: 1``). ``TUNE_GLOBAL_CHECKPOINT_S=0``
writes the experiment state at every step of Tune's loop, so it is always written between a trial's start and
its worker's death (the window that made ``tests/search/test_failures.py`` flaky, seen in CI). The first experiment
is Ray Tune's own ``Tuner`` (the control: the trial is left RUNNING on disk, read back as PENDING); the second is
built by :func:`nas.search.tune.make_tuner`, and is then restored and fitted again, as ``nas sweep --resume`` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, os, signal, sys, time
from pathlib import Path
import ray
from ray import tune

work = Path(sys.argv[1])

def trainable(config):
    with open(work / "attempts.txt", "a") as f:
        f.write(config["name"] + "\n")
    time.sleep(1.5)
    os.kill(os.getpid(), signal.SIGKILL)

ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
failure = tune.FailureConfig(max_failures=1)
tune.Tuner(trainable, param_space={"name": "ray"},
           run_config=tune.RunConfig(name="ray", storage_path=str(work), failure_config=failure, verbose=0)).fit()

from nas.search.tune import make_tuner, run_config
exp_dir = work / "nas"
for _ in range(2):  # the second time restores the experiment (nas sweep --resume)
    tuner, restored = make_tuner(trainable, exp_dir, restart_errored=False, param_space={"name": "nas"},
                                 run_config=run_config(exp_dir, [], max_failures=1))
    tuner.fit()
print(json.dumps({"restored": restored}))
"""


@pytest.fixture(scope="module")
def experiments(tmp_path_factory) -> tuple[Path, dict]:
    work = tmp_path_factory.mktemp("stopped_trials")
    env = {**os.environ, "TUNE_GLOBAL_CHECKPOINT_S": "0", "RAY_DEDUP_LOGS": "0",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(work)], capture_output=True, text=True, env=env,
                          cwd=work, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return work, json.loads(proc.stdout.strip().splitlines()[-1])


def _trials(exp_dir: Path) -> list:
    from ray.tune import ExperimentAnalysis

    return ExperimentAnalysis(str(exp_dir)).trials


def test_rays_own_loop_leaves_a_killed_trial_pending_on_disk(experiments):
    """The control: what ``save_stopped_trials`` mends. If Ray Tune fixes it, this fails, and the wrapper can go."""
    work, _ = experiments
    [trial] = _trials(work / "ray")
    assert trial.status == "PENDING" and trial.num_failures == 1  # its last write: the second attempt RUNNING


def test_a_killed_trial_is_error_on_disk_and_a_restore_does_not_run_it_again(experiments):
    work, out = experiments
    [trial] = _trials(work / "nas")
    assert trial.status == "ERROR" and trial.num_failures == 2
    assert out["restored"]
    attempts = (work / "attempts.txt").read_text().split()
    assert attempts.count("ray") == 2 and attempts.count("nas") == 2  # the restore ran no third attempt
