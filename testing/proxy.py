"""Running ``lgt-proxy`` in tests and benchmarks: the real proxy as a subprocess (``ProxyProc``), a free
port, the environment variables a test clears, SSE parsing, responses without their volatile fields, and
a chat request to send through the proxy to a hosted API's name (``HOSTED``, ``CHAT``, ``client``).

Imported in every environment (the proxy's has no torch): nothing heavy at import time.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lgt.proxy import auth
from lgt.proxy.client import ControlClient, resolve_token
from lgt.trainer.serving import children

if TYPE_CHECKING:
    import httpx

REPO = Path(__file__).resolve().parents[1]  # testing/ sits beside tests/ in the checkout

ENV_VARS = (
    "HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "ALL_PROXY", "all_proxy",
    "NO_PROXY", "no_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS", "LGT_PROXY_SECRET", "LGT_CONTROL_TOKEN", "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
)


VOLATILE = ("id", "created", "system_fingerprint")


def stable(obj: Any) -> Any:
    """A response without the fields that differ between any two calls."""
    if isinstance(obj, dict):
        return {k: stable(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [stable(v) for v in obj]
    return obj


def sse_objects(text: str) -> list[Any]:
    """The data of each SSE event of a response body: parsed JSON, or the string "[DONE]"."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def proxy_python() -> str:
    """The interpreter that runs ``lgt-proxy``: this one when it has mitmproxy, else the proxy's own
    environment (tests/trainer/ run in the trainer's, which has no mitmproxy)."""
    if os.environ.get("LGT_PROXY_PYTHON"):
        return os.environ["LGT_PROXY_PYTHON"]
    try:
        import mitmproxy  # noqa: F401
        return sys.executable
    except ImportError:
        return str(REPO / ".venv-proxy" / "bin" / "python")


class ProxyProc:
    """``lgt-proxy`` started for real as a subprocess (``python -m lgt.proxy.cli``)."""

    def __init__(self, store: Path | str, upstream: str | None = None, *args: str,
                 served_model: str | None = "policy", env: dict[str, str] | None = None) -> None:
        from lgt.store.remote import resolve

        self.extra_env = env or {}  # on top of this process's environment minus ENV_VARS

        self.store_arg = str(store)  # a folder, or s3://bucket/prefix (then .store is its local mirror)
        self.store = resolve(store)[0]
        self.upstream = upstream
        self.port = children.free_port()
        self.control_port = children.free_port()
        self.args = list(args)
        if upstream:
            self.args += ["--upstream", upstream]
            if served_model:
                self.args += ["--served-model", served_model]
        self.proc: subprocess.Popen | None = None
        self.log_path = self.store.parent / f"proxy-{self.port}.log"

    def start(self, timeout: float = 30) -> ProxyProc:
        cmd = [proxy_python(), "-m", "lgt.proxy.cli", "--store", self.store_arg,
               "--listen-port", str(self.port), "--control-port", str(self.control_port),
               "--flush-seconds", "0.2", *self.args]
        env = {**{k: v for k, v in os.environ.items() if k not in ENV_VARS}, **self.extra_env}
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

        def up() -> bool:  # its control API answers without a token (nor a secret)
            return children.listens(self.port) and ControlClient(self.control_url, "").healthz()

        if children.wait_until(up, self.proc, timeout, every=0.05):
            return self
        if self.proc.returncode is not None:
            raise RuntimeError(f"lgt-proxy exited with {self.proc.returncode}:\n{self.log_text()}")
        raise RuntimeError(f"lgt-proxy did not start in {timeout}s:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def secret(self) -> bytes:
        return auth.load_secret(self.store)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, rollout: str, attempt: int = 0, greedy: bool = False) -> dict[str, str]:
        return auth.rollout_env(self.store, rollout, attempt=attempt, port=self.port, greedy=greedy)

    def proxy_url(self, rollout: str, attempt: int = 0, greedy: bool = False) -> str:
        return self.env(rollout, attempt, greedy)["HTTPS_PROXY"]

    def base_url(self, rollout: str, attempt: int = 0, greedy: bool = False) -> str:
        return self.env(rollout, attempt, greedy)["LGT_PROXY_BASE_URL"]

    @property
    def ca_bundle(self) -> str:
        return str(auth.ca_bundle(auth.proxy_dir(self.store)))

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    @property
    def client(self) -> ControlClient:
        """The control API, with the token this proxy derived from its store's secret."""
        return ControlClient(self.control_url, resolve_token(store=self.store))

    def flush(self) -> None:
        self.client.flush()

    def calls(self, where: str = "true", params: list | None = None) -> list[dict[str, Any]]:
        """Rows of the calls view (after a flush), as dicts ordered by rollout, attempt, seq."""
        from lgt.store.query import connect

        self.flush()
        con = connect(self.store)
        cur = con.execute(f"SELECT * FROM calls WHERE {where} ORDER BY rollout_id, attempt, seq",
                          params or [])
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, row)) for row in cur.fetchall()]

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            children.stop(self.proc, 15, group=False)  # one process, in this one's group
        self.log.close()
        return self.proc.returncode

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()


# -- a chat call to a hosted API's name, through the proxy -----------------------------------------------

HOSTED = "https://api.openai.invalid/v1"
CHAT = {"model": "gpt-4o", "messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "What is 6*7?"}]}


def client(proxy: ProxyProc, rollout: str, **kw: Any) -> httpx.Client:
    """An httpx client that goes through ``proxy`` as ``rollout`` and trusts the proxy's CA."""
    import httpx

    ctx = ssl.create_default_context(cafile=proxy.ca_bundle)
    return httpx.Client(proxy=proxy.proxy_url(rollout), verify=ctx, trust_env=False,
                        timeout=kw.pop("timeout", 30), **kw)
