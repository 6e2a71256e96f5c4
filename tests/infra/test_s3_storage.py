"""``resources.storage_path`` on S3, against a real S3-compatible server (moto's, local; the ``s3_storage``
fixture): experiment paths that keep the URI's query last, and Ray state files set aside through the bucket.

The sweep on S3 whose driver is SIGKILLed mid-search and which resumes from the Ray Tune experiment kept in the
bucket runs in ``test_cluster.py`` (on its 2-node cluster, resumed there: one Ray cluster for both checks), reading
the bucket with :func:`tests.infra.conftest.bucket_names` and :func:`~tests.infra.conftest.bucket_ray_trials`.
"""

from __future__ import annotations

import pickle

import pytest

from nas.search.tune import ray_dir, restorable, run_config
from nas.space import parse_spec
from tests.conftest import tiny_spec_dict
from tests.infra.conftest import bucket_fs, bucket_names, bucket_ray_trials


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
    fs, path = bucket_fs(exp)

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
    names = bucket_names(exp)
    assert f"experiment_state-{newer}.json.corrupt" in names and f"experiment_state-{newer}.json" not in names
    assert f"search_gen_state-{newer}.json.ahead" in names  # it would go with the lost trial list
    assert f"experiment_state-{older}.json" in names and f"search_gen_state-{older}.json" in names

    put(f"search_gen_state-{older}.json", b"\x80\x05trunc")
    assert not restorable(exp) and bucket_names(exp) == []  # no searcher state: set aside, a fresh experiment
    (aside,) = [n for n in bucket_names(s3_storage) if n.startswith("sweep-search.unrestorable-")]
    assert f"experiment_state-{older}.json" in bucket_names(s3_storage.replace("/ray?", f"/ray/{aside}?"))

    put("tuner.pkl", pickle.dumps({"ok": 1})[:5])  # killed while Tuner() wrote it
    assert not restorable(exp)


def test_polling_a_ray_state_that_is_being_replaced_retries_until_it_reads_whole(tmp_path):
    """A cut-off ``experiment_state-*.json`` (a read racing Ray's upload) is read again until whole, not raised: the
    cluster test polls the bucket while the sweep writes it (a real ``ray.tune.ExperimentAnalysis`` on a local
    folder, which pyarrow reads like the bucket)."""
    import json
    import threading

    state = tmp_path / "experiment_state-2026-12-04_00-00-00.json"
    whole = json.dumps({"trial_data": []})
    state.write_text(whole[:7], encoding="utf-8")  # cut off mid-string, as the failing run read it
    timer = threading.Timer(1.2, lambda: state.write_text(whole, encoding="utf-8"))
    timer.start()
    try:
        assert bucket_ray_trials(str(tmp_path)) == []
    finally:
        timer.cancel()
    state.write_text(whole[:7], encoding="utf-8")  # never whole: the decode error, after the attempts
    with pytest.raises(json.JSONDecodeError):
        bucket_ray_trials(str(tmp_path), attempts=2)
