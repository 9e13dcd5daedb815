import dask
import pytest
from pydantic import SecretStr, ValidationError

from prefect_ddp.blocks.cluster import TRAINING_DASK_CONFIG, DaskCluster
from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.config import ClusterConfig, DataConfig, TrainingConfig
from prefect_ddp.tasks.data.storage import write_bytes
from prefect_ddp.tasks.urls import child_url


@pytest.mark.unit
def test_data_needs_a_url_or_a_block():
    with pytest.raises(ValidationError, match="data needs `url`.*or `block`"):
        DataConfig()


@pytest.mark.unit
def test_cluster_rejects_block_and_address_together():
    with pytest.raises(ValidationError, match="both block='gpu-box' and address='tcp://h:8786'"):
        ClusterConfig(block="gpu-box", address="tcp://h:8786")


@pytest.mark.unit
def test_misspelt_parameters_are_rejected():
    with pytest.raises(ValidationError, match="epoch"):
        TrainingConfig(epoch=3)


@pytest.mark.unit
def test_bounds_are_enforced():
    with pytest.raises(ValidationError, match="val_fraction"):
        DataConfig(url="s3://b/p", val_fraction=1.0)


@pytest.mark.unit
def test_secret_stays_out_of_repr_and_reaches_storage_options():
    location = DataLocation(url="s3://b/p", aws_access_key_id="AKIA", aws_secret_access_key="s3cr3t",
                            endpoint_url="http://127.0.0.1:9", region_name="eu-west-1")
    assert "s3cr3t" not in repr(location) and "s3cr3t" not in str(location.model_dump())
    assert location.storage_options() == {
        "anon": False, "endpoint_url": "http://127.0.0.1:9", "key": "AKIA", "secret": "s3cr3t",
        "client_kwargs": {"region_name": "eu-west-1"},
    }
    assert isinstance(location.with_url("s3://b/other").aws_secret_access_key, SecretStr)


@pytest.mark.unit
def test_anonymous_and_local_locations():
    assert DataLocation(url="s3://pub/p", anonymous=True, aws_access_key_id="x").storage_options() == {"anon": True}
    assert DataLocation(url="/data/images").storage_options() == {}


@pytest.mark.unit
def test_cluster_block_with_address_connects_instead_of_creating():
    runner = DaskCluster(address="tcp://10.0.0.5:8786").task_runner()
    assert runner.address == "tcp://10.0.0.5:8786"
    local = DaskCluster(n_workers=3, gpu=False).task_runner()
    assert local.cluster_kwargs == {"n_workers": 3, "threads_per_worker": 1, "security": True}


@pytest.mark.unit
def test_a_tls_address_without_a_certificate_is_refused_naming_where_one_comes_from():
    """Dask's own error was "TLS expects a ssl_context argument", at the first connection."""
    with pytest.raises(ValueError, match=r"cluster.address tls://127.0.0.1:1 is a TLS scheduler, and this process "
                       r"holds no certificate for it.*distributed.comm.tls.client.cert"):
        DaskCluster(address="tls://127.0.0.1:1").task_runner()


@pytest.mark.unit
def test_training_clusters_are_not_daemonic_and_do_not_trim_malloc():
    assert TRAINING_DASK_CONFIG["distributed.worker.daemon"] is False
    assert TRAINING_DASK_CONFIG["distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"] is None


def test_workers_of_a_training_cluster_run_without_the_profiler(dask_cluster):
    from distributed import Client

    with Client(dask_cluster.scheduler_address) as client:
        settings = client.run(lambda: dask.config.get("distributed.worker.profile.enabled"))
    assert set(settings.values()) == {False}


@pytest.mark.unit
@pytest.mark.parametrize("part", ["..", ".", "", "a/b", "..\\x", "/etc"])
def test_child_url_refuses_to_escape_the_prefix(part):
    with pytest.raises(ValueError, match="is not allowed below 's3://b/out'"):
        child_url("s3://b/out", part)


@pytest.mark.unit
def test_local_writes_are_atomic(tmp_path):
    target = tmp_path / "run" / "metrics.json"
    write_bytes(str(target), b"{}", {})
    write_bytes(str(target), b'{"a": 1}', {})
    assert target.read_bytes() == b'{"a": 1}'
    assert [p.name for p in target.parent.iterdir()] == ["metrics.json"]


@pytest.mark.unit
@pytest.mark.parametrize("name, expected", [("crafty-owl", "crafty-owl"), ("a/../b", "a-..-b"), ("..", "run"), ("nightly run #3", "nightly-run-3")])
def test_run_names_become_one_safe_segment(name, expected):
    from prefect_ddp.tasks.urls import safe_segment

    assert safe_segment(name) == expected
    child_url("s3://b/out", safe_segment(name))  # never raises


@pytest.mark.unit
def test_a_local_folder_that_is_not_there_or_empty_is_named_as_such(tmp_path):
    """It was a ConnectionError, "Cannot reach ... Check endpoint_url" (an IndexError looking for its bucket)."""
    from prefect_ddp.tasks.data.validation import validate_source

    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "gone", tmp_path / "empty"):
        with pytest.raises(FileNotFoundError, match=f"'{folder}' is empty or does not exist: expected an image folder"):
            validate_source.fn(DataLocation(url=str(folder)))


# Not `unit` (it starts nothing): botocore's retries and backoff take 7-10 s.
def test_an_unreachable_endpoint_is_named_in_the_error():
    from prefect_ddp.tasks.data.validation import validate_source

    location = DataLocation(url="s3://b/p", endpoint_url="http://127.0.0.1:1", aws_access_key_id="a",
                            aws_secret_access_key="b", region_name="us-east-1")
    with pytest.raises(ConnectionError, match=r"Cannot reach 's3://b/p' .*Check endpoint_url \(http://127.0.0.1:1\)"):
        validate_source.fn(location)
