"""The same recipe with run storage on s3://, against moto's S3 server on loopback."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import s3fs

from tests.conftest import REPO, TINY, run_unirl
from tests.e2e.test_rl_flow import SIGNAL, STAGE_FILES
from tests.moto_s3 import moto_endpoint

pytestmark = pytest.mark.slow


@pytest.fixture
def s3_server():
    with moto_endpoint() as url:
        yield url


def test_run_on_s3(tmp_path, unirl_env, s3_server):
    env = {
        **unirl_env, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_server,
        # iteration flow runs one after the other (started ahead is the default, run by the rest of the suite)
        "UNIRL_OVERLAP_ITERATIONS": "off",
    }
    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": s3_server})
    fs.mkdir("unirl-ar-runs")
    args = ["run", str(TINY), "iterations=2", "storage.root=s3://unirl-ar-runs/team", SIGNAL]
    run_unirl(args, env)
    base = "unirl-ar-runs/team/tiny"
    for i in range(2):
        for name in STAGE_FILES:
            assert fs.exists(f"{base}/iter-{i:06d}/{name}"), name
        with fs.open(f"{base}/iter-{i:06d}/rollouts/part-000.arrow", "rb") as fh:
            assert ipc.open_file(pa.py_buffer(fh.read())).read_all().num_rows == 32
    assert json.loads(fs.cat(f"{base}/checkpoints/000002/_COMMITTED"))["version"] == 2
    assert any(p.endswith(".safetensors") for p in fs.ls(f"{base}/checkpoints/000002/state")), "checkpoint shards not in the bucket"
    assert fs.exists(f"{base}/weights/v000002/model.safetensors")
    assert not (REPO / "s3:").exists(), "an s3:// path was written to local disk"
    # Resume on s3: a third iteration starts from the checkpoint in the bucket.
    out = run_unirl(["run", str(TINY), "iterations=3", "storage.root=s3://unirl-ar-runs/team", SIGNAL], env)
    assert "iter-000002 (3/3)" in out.stdout and "iter-000000 (1/3)" not in out.stdout
    assert fs.exists(f"{base}/iter-000002/_SUCCESS")
