"""``resources.storage_path`` on S3, against a real S3-compatible server (moto's, local; the ``s3_storage``
fixture): experiment paths that keep the URI's query last, Ray state files set aside through the bucket, and a
sweep whose driver is SIGKILLed mid-search and which resumes from the Ray Tune experiment kept in the bucket.
"""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from nas.search.tune import ray_dir, restorable, run_config
from nas.space import parse_spec
from tests.conftest import completed_trials, kill_driver, nas_env, run_nas, sweep_with_supernet, tiny_spec_dict

TRIALS = 4


def _bucket(uri: str):
    """(pyarrow filesystem, ``bucket/key`` path) of an ``s3://`` URI with its query."""
    import pyarrow.fs

    return pyarrow.fs.FileSystem.from_uri(uri)


def _names(uri: str) -> list[str]:
    import pyarrow.fs

    fs, path = _bucket(uri)
    return sorted(i.base_name for i in fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True)))


def test_experiment_uris_keep_the_query_last(multi30k, tmp_path):
    storage = "s3://bucket/nas/?endpoint_override=127.0.0.1:8333&scheme=http"
    spec = parse_spec(tiny_spec_dict(multi30k, tmp_path, resources={"cpu": 1, "storage_path": storage}))
    exp = ray_dir(spec, "tiny-1", "search")
    assert exp == "s3://bucket/nas/tiny-1-search?endpoint_override=127.0.0.1:8333&scheme=http"
    config = run_config(exp, [], 0)
    assert (config.storage_path, config.name) == ("s3://bucket/nas?endpoint_override=127.0.0.1:8333&scheme=http",
                                                  "tiny-1-search")


def test_ray_state_files_cut_short_by_a_kill_are_set_aside_in_the_bucket(s3_storage):
    from ray import cloudpickle

    exp = s3_storage.replace("/ray?", "/ray/sweep-search?")
    fs, path = _bucket(exp)

    def put(name: str, blob: bytes) -> None:
        with fs.open_output_stream(f"{path}/{name}") as f:
            f.write(blob)

    assert not restorable(exp)  # nothing there yet
    put("tuner.pkl", pickle.dumps({"ok": 1}))
    older, newer = "2026-01-01_00-00-00", "2026-01-01_00-10-00"
    put(f"experiment_state-{older}.json", b'{"trial_data": []}')
    put(f"experiment_state-{newer}.json", b'{"trial_da')  # cut short (a copy made before the upload)
    for session in (older, newer):
        put(f"search_gen_state-{session}.json", cloudpickle.dumps({"counter": 1}))
    assert restorable(exp)
    names = _names(exp)
    assert f"experiment_state-{newer}.json.corrupt" in names and f"experiment_state-{newer}.json" not in names
    assert f"search_gen_state-{newer}.json.ahead" in names  # it would go with the lost trial list
    assert f"experiment_state-{older}.json" in names and f"search_gen_state-{older}.json" in names

    put(f"search_gen_state-{older}.json", b"\x80\x05trunc")
    assert not restorable(exp) and _names(exp) == []  # no searcher state: set aside, a fresh experiment
    (aside,) = [n for n in _names(s3_storage) if n.startswith("sweep-search.unrestorable-")]
    assert f"experiment_state-{older}.json" in _names(s3_storage.replace("/ray?", f"/ray/{aside}?"))

    put("tuner.pkl", pickle.dumps({"ok": 1})[:5])  # killed while Tuner() wrote it
    assert not restorable(exp)


def _ray_trials(exp: str) -> list:
    """The Ray Tune trials of the experiment at ``exp``, read from the bucket (none before its first state)."""
    from ray.tune import ExperimentAnalysis

    if not any(n.startswith("experiment_state-") and n.endswith(".json") for n in _names(exp)):
        return []
    return ExperimentAnalysis(exp).trials


@pytest.mark.slow
def test_sweep_on_s3_killed_mid_search_resumes_from_the_experiment_in_the_bucket(multi30k, tmp_path, tiny_supernet,
                                                                                 s3_storage):
    from optuna.trial import TrialState

    from nas import tracking
    from nas.search.runner import read_sweep_record, study_ref
    from nas.space import load_spec

    raw = tiny_spec_dict(multi30k, tmp_path, search={"trials": TRIALS, "max_concurrent": 2, "beam_size": 2,
                                                     "latency_sentences": 2},
                         resources={"cpu": 1, "storage_path": s3_storage}, tracking={"experiment": "s3"})
    spec_file = sweep_with_supernet(raw, tmp_path, tiny_supernet)
    env = nas_env(tmp_path)  # with the fixture's AWS_* credentials
    run_dir = tmp_path / "runs" / "tiny"
    log = tmp_path / "killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "nas.cli", "sweep", str(spec_file)], env=env, cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        try:
            exp = None
            while True:  # a trial complete in Optuna, and Ray's experiment state in the bucket
                assert proc.poll() is None, f"the sweep ended before it could be killed:\n{log.read_text()[-4000:]}"
                assert time.monotonic() < deadline, "no trial completed and uploaded in 600 s"
                if exp is None and (record := read_sweep_record(run_dir)) is not None:
                    exp = ray_dir(load_spec(spec_file, check_files=False), record.sweep_id, "search")
                if exp is not None and completed_trials(run_dir) and (before := _ray_trials(exp)):
                    break
                time.sleep(0.5)
        finally:
            kill_driver(proc)
    assert proc.returncode == -signal.SIGKILL
    spec = load_spec(spec_file, check_files=False)
    sweep_id = read_sweep_record(run_dir).sweep_id
    assert len([t for t in study_ref(spec, sweep_id).load().get_trials() if t.state == TrialState.COMPLETE]) < TRIALS, \
        "killed too late to test resume"
    assert not (run_dir / "ray").exists()  # Ray kept nothing beside the sweep: all of it is in the bucket

    resumed = run_nas(["sweep", "--resume", "tiny", "--workdir", "runs"], env, tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert "(restored" in resumed.stderr, resumed.stderr[-3000:]  # Tuner.restore from the bucket, not afresh

    after = _ray_trials(exp)
    assert {t.trial_id for t in before} <= {t.trial_id for t in after}  # the trials Ray had uploaded, restored
    assert Counter(t.config["optuna_trial"] for t in after) == Counter(range(TRIALS))  # one Ray trial each
    assert {t.status for t in after} == {"TERMINATED"}
    optuna_trials = study_ref(spec, sweep_id).load().get_trials()
    assert len(optuna_trials) == TRIALS and all(t.state == TrialState.COMPLETE for t in optuna_trials)
    tracking_uri = env["MLFLOW_TRACKING_URI"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", tracking_uri)
        runs = tracking.find_tagged_runs(spec.experiment, {tracking.TAG_SWEEP_ID: sweep_id})
    trial_runs = [r for r in runs if r.data.tags.get(tracking.TAG_ROLE) == "trial"]
    assert sorted(int(r.data.tags[tracking.TAG_OPTUNA_TRIAL]) for r in trial_runs) == list(range(TRIALS))
    assert {r.info.status for r in runs} == {"FINISHED"}, Counter(r.info.status for r in runs)
    names = _names(exp)
    assert len([n for n in names if n.startswith("experiment_state-") and n.endswith(".json")]) == 2  # 2 drivers
    assert "tuner.pkl" in names and not (run_dir / "ray").exists()
