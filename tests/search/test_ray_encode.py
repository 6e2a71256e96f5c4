"""nas.search.ray_encode: a preparation whose shards are encoded by Ray tasks (``nas sweep --address``) writes the
file a local preparation writes, with a bounded number of shards in flight."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.ipc
import pytest
import ray

import nas.data.cache as cache_module
from nas.data import prepare_data, read_lines
from nas.search.ray_encode import RayEncoders

pytestmark = pytest.mark.slow  # a local Ray cluster: 10-13 s on 2 cores, out of the inner loop (pytest -m "not slow")

SMALL = {"vocab_size": 400, "max_train_pairs": 1000, "max_valid_pairs": 20, "progress": False}


@pytest.fixture(scope="module")
def files(multi30k: Path) -> list[Path]:
    return [multi30k / name for name in ("train.en.gz", "train.de.gz", "val.en.gz", "val.de.gz")]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def _train_table(root: Path) -> pa.Table:
    with pa.memory_map(str(root / "train.arrow")) as source:
        return pa.ipc.open_file(source).read_all()


def test_shards_encoded_on_ray_equal_a_local_preparation(files, tmp_path, monkeypatch, local_ray):
    monkeypatch.setattr(cache_module, "_SHARD_PAIRS", 200)  # 5 shards
    pools: list[RayEncoders] = []

    def on_ray(model, work, max_len):
        pools.append(RayEncoders(model, work, max_len, in_flight=2))
        return pools[-1]

    local = prepare_data(*files, cache_dir=tmp_path / "local", **SMALL)
    remote = prepare_data(*files, cache_dir=tmp_path / "ray", encoders=on_ray, **SMALL)
    assert len(pools) == 1 and not pools[0].pending  # every shard went through Ray and was written
    assert Path(remote.root).name == Path(local.root).name  # the same entry (the key ignores where it encoded)
    local_table, remote_table = _train_table(Path(local.root)), _train_table(Path(remote.root))
    assert remote_table.num_rows == local_table.num_rows > 900 and remote_table.equals(local_table)


def test_at_most_in_flight_shards_are_pending_and_each_is_written(files, tmp_path, local_ray):
    prepared = prepare_data(*files, cache_dir=tmp_path / "cache", **SMALL)  # for its tokenizer
    work = tmp_path / "work"
    work.mkdir()
    pool = RayEncoders(Path(prepared.root) / "spm.model", work, 128, in_flight=2)
    lines = read_lines(files[0], limit=50), read_lines(files[1], limit=50)
    written = []
    for shard in range(6):
        written += pool.submit(shard, *lines)
        assert len(pool.pending) <= 2
    written += list(pool.drain())
    assert written == [50] * 6 and sorted(p.name for p in work.iterdir()) == [f"shard-{i:05d}.arrow" for i in range(6)]


def test_a_failing_task_fails_the_preparation_naming_its_cause(files, tmp_path, local_ray):
    bad = tmp_path / "spm.model"
    bad.write_bytes(b"not a sentencepiece model")
    pool = RayEncoders(bad, tmp_path, 128)
    pool.submit(0, ["a"], ["b"])
    with pytest.raises(ray.exceptions.RayTaskError, match="(?i)sentencepiece|ParseFromArray|model"):
        list(pool.drain())
    pool.close()
    assert not (tmp_path / "shard-00000.arrow").exists()


def test_a_sweep_with_an_address_encodes_on_that_cluster(files, tmp_path, local_ray):
    """``nas sweep --address``'s data step: the runner's factory joins the cluster (here: the one this process
    joined already, so it records no new connection) and returns Ray encoders."""
    from nas.search.ray_session import cluster_encoders

    connected: list[bool] = []
    prepared = prepare_data(*files, cache_dir=tmp_path / "cache",
                            encoders=cluster_encoders(ray.get_runtime_context().gcs_address, connected), **SMALL)
    assert connected == [False] and _train_table(Path(prepared.root)).num_rows > 900
