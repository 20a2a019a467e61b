"""``lgt-train run`` with ``store: s3://bucket/prefix``, against a local S3 server (moto in server mode,
run from the proxy's environment, which has it): the run trains, its calls, rollouts and rewards land in
the bucket as whole Parquet files, and another machine's ``lgt-train sql`` reads them from there."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

pafs = pytest.importorskip("pyarrow.fs")
pytestmark = pytest.mark.slow

BUCKET = "lgt-runs"


def moto_python() -> str:
    """An interpreter with moto: the proxy's environment (the trainer's cannot hold it: botocore wants
    python-dateutil<3, the kubernetes client >=3)."""
    here = Path(__file__).resolve().parents[2] / ".venv-proxy" / "bin" / "python"
    return os.environ.get("LGT_PROXY_PYTHON") or str(here)


@pytest.fixture
def s3(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([moto_python(), "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", access_key="test",
                           secret_key="test", region="us-east-1", allow_bucket_creation=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            fs.create_dir(BUCKET)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.skip("no local S3 server (moto) in the proxy's environment")
            time.sleep(0.2)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
           "LGT_STORE_CACHE": str(tmp_path / "machine-a")}
    yield fs, env
    proc.terminate()
    proc.wait(10)


def test_a_run_on_an_s3_store(tmp_path, arith_model_dir, arith_engine, s3):
    from lgt.testing.runs import lgt_train, lgt_train_cmd, metrics, write_config

    fs, env = s3
    store = f"s3://{BUCKET}/arith/one"
    cfg = write_config(tmp_path, arith_model_dir, engine_url=arith_engine.url, steps=2, store=store)
    out = lgt_train(str(cfg), "--run-dir", str(tmp_path / "run"), env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]
    infos = fs.get_file_info(pafs.FileSelector(f"{BUCKET}/arith/one", recursive=True))
    tables = {i.path.split("/")[3] for i in infos if i.path.endswith(".parquet")}
    assert {"calls", "rollouts"} <= tables  # the proxy's and the trainer's files, whole
    assert not [i for i in infos if "/_wal/" in i.path or "/_proxy/" in i.path]
    # another machine (an empty mirror) reads the run from the bucket
    query = "SELECT count(DISTINCT group_id) >= 4 AS ok, count(*) > 0 AS some FROM rollouts"
    out = lgt_train_cmd("sql", "--store", store, "--format", "csv", query,
                        env={**env, "LGT_STORE_CACHE": str(tmp_path / "machine-b")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ok,some", "true,true"], out.stdout
