"""A store on S3 (``--store s3://bucket/prefix``), against a local S3 server (moto in server mode):
whole Parquet files are uploaded as they are made, the write-ahead log and the proxy's secrets stay on
the machine, a reader elsewhere queries the bucket through its own mirror, and a proxy killed with -9
uploads what its log held when it restarts."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from lgt.testing.proxy import ProxyProc

moto_server = pytest.importorskip("moto.server")
pafs = pytest.importorskip("pyarrow.fs")

BUCKET = "lgt-test"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is 2+3?"}]}


@pytest.fixture
def s3(tmp_path, monkeypatch) -> Iterator[pafs.S3FileSystem]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for k, v in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
                 "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                 "LGT_STORE_CACHE": str(tmp_path / "machine-a")}.items():
        monkeypatch.setenv(k, v)
    fs = pafs.S3FileSystem(endpoint_override=f"{host}:{port}", scheme="http", access_key="test",
                           secret_key="test", region="us-east-1", allow_bucket_creation=True)
    fs.create_dir(BUCKET)
    yield fs
    server.stop()


def keys(fs: pafs.S3FileSystem, prefix: str) -> list[str]:
    infos = fs.get_file_info(pafs.FileSelector(f"{BUCKET}/{prefix}", recursive=True, allow_not_found=True))
    return sorted(i.path.removeprefix(f"{BUCKET}/{prefix}/") for i in infos if i.type == pafs.FileType.File)


def call(proxy: ProxyProc, rollout: str) -> None:
    env = proxy.env(rollout)
    with httpx.Client(proxy=env["HTTPS_PROXY"], verify=env["SSL_CERT_FILE"], trust_env=False) as c:
        assert c.post("https://api.openai.invalid/v1/chat/completions", json=CHAT).status_code == 200


def lgt_train_sql(store: str, query: str, cache: str) -> str:
    import os

    out = subprocess.run([sys.executable, "-m", "lgt.trainer.cli", "sql", "--store", store, "--format", "csv",
                          query], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LGT_STORE_CACHE": cache})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_proxy_uploads_whole_parquet_files_and_a_reader_elsewhere_sees_them(s3, upstream, tmp_path):
    p = ProxyProc(f"s3://{BUCKET}/runs/one", upstream.url).start()
    try:
        assert p.store == (tmp_path / "machine-a" / BUCKET / "runs" / "one").resolve()  # the local mirror
        call(p, "r1")
        call(p, "r2")
        p.flush()  # flushed means in the bucket
        uploaded = keys(s3, "runs/one")
        assert [k for k in uploaded if k.startswith("calls/")] and all(
            k.endswith(".parquet") for k in uploaded if k.startswith("calls/"))
        assert not [k for k in uploaded if k.startswith(("_wal/", "_proxy/"))]  # never leave the machine
        # another machine: its own (empty) mirror, filled from the bucket
        out = lgt_train_sql(f"s3://{BUCKET}/runs/one", "SELECT rollout_id FROM calls ORDER BY 1",
                            str(tmp_path / "machine-b"))
        assert out.split() == ["rollout_id", "r1", "r2"]
        assert list((tmp_path / "machine-b" / BUCKET / "runs" / "one" / "calls").glob("*.parquet"))
    finally:
        p.stop()


def test_a_proxy_killed_before_its_upload_uploads_on_restart(s3, upstream):
    p = ProxyProc(f"s3://{BUCKET}/runs/two", upstream.url, "--flush-seconds", "600").start()
    call(p, "before-kill")
    p.kill9()  # the call is only in the local write-ahead log
    assert not [k for k in keys(s3, "runs/two") if k.startswith("calls/")]
    again = ProxyProc(f"s3://{BUCKET}/runs/two", upstream.url).start()  # recovers it, then uploads it
    try:
        assert [k for k in keys(s3, "runs/two") if k.startswith("calls/")]
    finally:
        again.stop()


def test_a_bad_store_url_is_one_sentence(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "lgt.proxy.cli", "--store", "s3://", "--listen-port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "'s3://' is not an s3://bucket/prefix store" in out.stderr
