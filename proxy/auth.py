"""Rollout identity, the proxy's secret, and the environment a rollout needs to go through the proxy.

A rollout authenticates with proxy credentials ``<identity>:<token>`` where ``identity`` is the rollout
id, optionally followed by ``~<attempt>`` and then ``~greedy``, and ``token = HMAC-SHA256(secret,
identity)`` (hex, 32 chars). The proxy needs no registry of rollouts: whoever holds the secret can mint
credentials. ``~greedy`` (held-out evaluation) makes the proxy decode that rollout's calls greedily
whatever temperature the agent asks for; being part of the signed identity, an agent cannot set or drop
it.

The secret lives with the store (``<store>/_proxy/secret``, mode 0600) unless ``LGT_PROXY_SECRET`` or an
explicit file is given, so ``lgt-proxy creds`` and a running ``lgt-proxy`` agree without flags. This
module imports no mitmproxy at import time: the trainer's environment uses it too.
"""

from __future__ import annotations

import base64
import hmac
import os
import re
import secrets
import ssl
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

from lgt.store.files import write_atomic

SECRET_ENV = "LGT_PROXY_SECRET"
CONTROL_TOKEN_ENV = "LGT_CONTROL_TOKEN"
# the variables a rollout's environment points at the CA bundle with (one per client family)
CA_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")
PROXY_DIR = "_proxy"
ROLLOUT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
CA_NAME = "mitmproxy"  # mitmproxy's file prefix inside its confdir


class AuthError(ValueError):
    """Credentials that are missing or wrong; the message is safe to show (it names no secret)."""


GREEDY = "greedy"  # the identity suffix that makes the proxy decode a rollout's calls greedily


@dataclass(frozen=True)
class Identity:
    rollout_id: str
    attempt: int = 0
    greedy: bool = False  # the proxy forces greedy decoding (temperature 0) on this rollout's calls

    @property
    def name(self) -> str:
        if self.greedy:
            return f"{self.rollout_id}~{self.attempt}~{GREEDY}"
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}~{self.attempt}"


def check_rollout_id(rollout_id: str) -> str:
    if not ROLLOUT_ID_RE.match(rollout_id or ""):
        raise ValueError(
            f"rollout id {rollout_id!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return rollout_id


def parse_identity(name: str) -> Identity:
    head, sep, mode = name.rpartition("~")
    greedy = bool(sep) and mode == GREEDY
    rollout_id, sep, attempt = (head if greedy else name).rpartition("~")
    if not sep:
        rollout_id, attempt = (head if greedy else name), "0"
    if not attempt.isdigit() or not ROLLOUT_ID_RE.match(rollout_id):
        raise AuthError(f"proxy user {name!r} is not a rollout id (optionally ~attempt, then ~{GREEDY})")
    return Identity(rollout_id, int(attempt), greedy)


# -- the secret ---------------------------------------------------------------------------------
def proxy_dir(store: str | os.PathLike) -> Path:
    return Path(store) / PROXY_DIR


def load_secret(store: str | os.PathLike | None, secret_file: str | os.PathLike | None = None) -> bytes:
    """The HMAC secret: ``$LGT_PROXY_SECRET``, else ``secret_file``, else ``<store>/_proxy/secret``
    (generated, owner-only, when absent)."""
    env = os.environ.get(SECRET_ENV)
    if env:
        return env.encode()
    if secret_file is None:
        if store is None:
            raise ValueError("no secret: give --store, --secret-file or set LGT_PROXY_SECRET")
        secret_file = proxy_dir(store) / "secret"
    path = Path(secret_file)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # first writer wins; a concurrent creator then reads the winner's
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    secret = path.read_text().strip()
    if not secret:
        raise ValueError(f"secret file {path} is empty")
    return secret.encode()


def rollout_token(secret: bytes, identity: Identity | str) -> str:
    name = identity.name if isinstance(identity, Identity) else identity
    return hmac.new(secret, name.encode(), sha256).hexdigest()[:32]


def control_token(secret: bytes) -> str:
    """Bearer token of the control API: ``$LGT_CONTROL_TOKEN`` or derived from the secret."""
    return os.environ.get(CONTROL_TOKEN_ENV) or hmac.new(secret, b"lgt-control", sha256).hexdigest()


def verify(secret: bytes, user: str, token: str) -> Identity:
    identity = parse_identity(user)
    if not hmac.compare_digest(rollout_token(secret, identity), token):
        raise AuthError(f"wrong proxy token for rollout {identity.name!r}")
    return identity


def parse_basic(header: str) -> tuple[str, str]:
    """``Basic base64(user:pass)`` → (user, pass); AuthError when malformed."""
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic":
        raise AuthError("proxy credentials must use Basic authentication")
    try:
        user, sep, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        raise AuthError("proxy credentials are not valid base64 user:password") from None
    if not sep:
        raise AuthError("proxy credentials have no password (the rollout token)")
    return user, password


# -- the CA bundle and a rollout's environment --------------------------------------------------
def ca_cert_path(confdir: str | os.PathLike) -> Path:
    return Path(confdir) / f"{CA_NAME}-ca-cert.pem"


def ensure_ca(confdir: str | os.PathLike) -> Path:
    """The proxy CA certificate, created with mitmproxy's own CertStore when absent."""
    cert = ca_cert_path(confdir)
    if not cert.exists():
        from mitmproxy.certs import CertStore  # only where mitmproxy is installed

        Path(confdir).mkdir(parents=True, exist_ok=True)
        CertStore.from_store(Path(confdir), CA_NAME, 2048)
    return cert


def system_ca_file() -> Path | None:
    paths = ssl.get_default_verify_paths()
    for candidate in (paths.cafile, paths.openssl_cafile, "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    try:
        import certifi

        return Path(certifi.where())
    except ImportError:
        return None


def system_bundle_with(extra: str | os.PathLike, bundle: str | os.PathLike) -> Path:
    """Write ``bundle``: the system CAs followed by the certificate(s) in ``extra`` (whole: temp
    file + rename; left alone when already up to date)."""
    bundle = Path(bundle)
    system = system_ca_file()
    parts = [system.read_bytes().rstrip(b"\n") + b"\n"] if system else []
    parts.append(Path(extra).read_bytes())
    data = b"".join(parts)
    if not bundle.exists() or bundle.read_bytes() != data:
        write_atomic(bundle, data)
    return bundle


def ca_bundle(confdir: str | os.PathLike) -> Path:
    """``ca-bundle.pem`` next to the CA: the system CAs followed by the proxy CA."""
    return system_bundle_with(ensure_ca(confdir), Path(confdir) / "ca-bundle.pem")


def absolute(path: str | os.PathLike) -> Path:
    """``path`` with ``~`` expanded, made absolute and free of symlinks and ``..``: what an agent is
    handed must name the same file from whatever directory it runs in."""
    return Path(path).expanduser().resolve()


def rollout_env(
    store: str | os.PathLike,
    rollout_id: str,
    *,
    attempt: int = 0,
    host: str = "127.0.0.1",
    port: int = 8080,
    secret_file: str | os.PathLike | None = None,
    confdir: str | os.PathLike | None = None,
    ca: str = "system+proxy",
    greedy: bool = False,
) -> dict[str, str]:
    """Environment variables that send one rollout's traffic through the proxy.

    ``NO_PROXY`` is emptied: several clients would otherwise bypass the proxy for loopback or for
    hosts a machine lists there, and a model server on 127.0.0.1 must still be intercepted.
    ``ca``: the CA file the variables name — ``system+proxy`` (the system CAs and the proxy's) or
    ``proxy`` (the proxy's alone: enough when every HTTPS connection goes through the proxy, which
    presents its own certificates, and ~50× cheaper for each client to load — it matters for agents
    that live a second). ``greedy``: the proxy decodes this rollout's calls greedily (evaluation).
    """
    if ca not in ("system+proxy", "proxy"):
        raise ValueError(f"ca must be 'system+proxy' or 'proxy', not {ca!r}")
    identity = Identity(check_rollout_id(rollout_id), attempt, greedy)
    store = absolute(store)
    secret = load_secret(store, None if secret_file is None else absolute(secret_file))
    token = rollout_token(secret, identity)
    url = f"http://{identity.name}:{token}@{host}:{port}"
    confdir = absolute(confdir) if confdir else proxy_dir(store)
    bundle = str(ca_bundle(confdir) if ca == "system+proxy" else ensure_ca(confdir))
    env = {}
    for var in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        env[var] = url
    for var in ("NO_PROXY", "no_proxy"):
        env[var] = ""
    for var in CA_VARS:
        env[var] = bundle
    env["LGT_ROLLOUT_ID"] = identity.rollout_id
    env["LGT_ATTEMPT"] = str(identity.attempt)
    env["LGT_PROXY_BASE_URL"] = f"http://{host}:{port}/r/{identity.name}/{token}/v1"
    env["LGT_REWARD_URL"] = "http://lgt.invalid/reward"  # POST {"value": 1.0} through the proxy
    return env
