"""PostgreSQL as the Optuna storage, without a sweep: an unreachable server exits 2 naming the (masked) URL, and the
password stays out of what Ray pickles and the sweep record. A sweep of 2 concurrent trials on PostgreSQL for both
Optuna and MLflow is tested on the combined backends sweep (``tests/infra/test_backends_sweep.py``)."""

from __future__ import annotations

import pytest

from tests.conftest import nas_env, run_nas, tiny_spec_dict


@pytest.mark.slow
def test_unreachable_optuna_postgres_exits_2_naming_the_storage(multi30k, tmp_path):
    raw = tiny_spec_dict(multi30k, tmp_path, tracking={"experiment": "pg",
                                                       "optuna_storage": "postgresql://nas:secret@127.0.0.1:1/optuna"})
    spec_file = tmp_path / "tiny.yaml"
    import yaml

    spec_file.write_text(yaml.safe_dump(raw))
    proc = run_nas(["sweep", str(spec_file)], nas_env(tmp_path), tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = proc.stderr.replace("\n", "")
    assert "tracking.optuna_storage" in message and "postgresql://nas:***@127.0.0.1:1/optuna" in message
    assert "secret" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs" / "tiny" / "sweep.json").exists()  # nothing half-started to trip a retry


def test_storage_password_stays_out_of_tuner_pickle_and_sweep_record(multi30k, tmp_path):
    import json
    import pickle

    from nas.search.runner import SweepRecord, _settings, study_ref
    from nas.search.searcher import _REAL_URLS
    from nas.space import parse_spec

    spec = parse_spec(tiny_spec_dict(multi30k, tmp_path, tracking={"optuna_storage": "postgresql://nas:s3cret@db:5432/optuna"}))
    ref = study_ref(spec, "tiny-1")
    blob = pickle.dumps(ref)  # what Ray writes into tuner.pkl (inside the searcher)
    assert b"s3cret" not in blob and pickle.loads(blob).storage_url.endswith(":s3cret@db:5432/optuna")
    _REAL_URLS.clear()  # another process: the password is not there to be found
    assert pickle.loads(blob).storage_url == "postgresql://nas:***@db:5432/optuna"
    record = SweepRecord("tiny-1", "tiny", "now", "f.yaml", str(tmp_path), _settings(spec))
    assert "s3cret" not in json.dumps(record.__dict__)


def test_opening_an_unreachable_study_storage_names_the_masked_url(tmp_path):
    from nas.search.searcher import StudyRef
    from nas.space import SpecError

    with pytest.raises(SpecError, match=r"tracking.optuna_storage: cannot open .* postgresql://nas:\*\*\*@127.0.0.1:1/o") as e:
        StudyRef("s", tmp_path / "j", "postgresql://nas:s3cret@127.0.0.1:1/o").storage()
    assert "s3cret" not in str(e.value)
