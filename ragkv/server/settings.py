"""Server settings and the API keys file (bearer key -> tenant)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ragkv.server.quotas import TenantQuota
from ragkv.types import validate_tenant

__all__ = ["STEP_MS", "ServerSettings", "load_api_keys", "load_tenant_quotas"]

# A prefill piece's time while streams decode (docs/serving.md, "Prefill pieces": chosen by measurement)
STEP_MS = 1000.0


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """How ``ragkv serve`` listens and what it accepts."""

    host: str = "127.0.0.1"  # loopback by default: expose it on purpose (with --api-keys)
    port: int = 8000
    api_keys: dict[str, str] = field(default_factory=dict, repr=False)  # bearer key -> tenant; {} = no auth
    max_batch: int = 8  # requests decoded together in one forward pass
    step_tokens: int = 256  # prompt tokens a prefill piece runs between two decode steps; 0: whole prefills
    step_ms: float = STEP_MS  # a prefill piece's time while streams decode (CPU; from the rate measured); 0: off
    carry_steps: bool = True  # decode steps ride on full-prefill pieces where they can (Scheduler carry)
    max_queue: int = 32  # requests held (waiting + decoding); past it, 429 with Retry-After
    max_body_bytes: int = 8 * 1024 * 1024  # larger /v1/documents bodies (uploads) get 413
    max_json_bytes: int = 1024 * 1024  # larger JSON bodies on the other /v1 routes get 413
    max_json_depth: int = 64  # JSON nested deeper gets 400 (before it is parsed)
    max_embedding_inputs: int = 256  # texts one /v1/embeddings request may send
    max_embedding_chars: int = 1024 * 1024  # their total characters
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides loopback and --host; "*": any
    metrics_key: str | None = field(default=None, repr=False)  # a bearer token for /metrics only
    access_log: bool = True  # one line per request on the ragkv.server.access logger
    log_json: bool = False  # that line as JSON (RAGKV_LOG_JSON=1)
    max_tokens_limit: int = 2048  # the largest max_tokens a request may ask for
    header_timeout_s: float = 10.0  # a connection that has not sent a whole request head by then is closed
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this long (uvicorn)
    max_connections: int = 256  # open connections at most; past it new ones get 503 (uvicorn limit_concurrency)
    quota: TenantQuota = field(default_factory=TenantQuota)  # every tenant's, unless set below
    tenant_quotas: dict[str, TenantQuota] = field(default_factory=dict)  # tenant -> its own (keys file)
    drain_s: float = 10.0  # at shutdown, how long running requests may take to finish
    model_name: str = "ragkv"  # the model id /v1/models lists (requests may name any model)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_batch < 1 or self.max_queue < self.max_batch:
            raise ValueError("need max_batch >= 1 and max_queue >= max_batch (requests held, decoding included)")
        if self.step_tokens < 0:
            raise ValueError(f"step_tokens must be >= 0 (0: each prefill runs whole), got {self.step_tokens}")
        if not self.step_ms >= 0:
            raise ValueError(f"step_ms must be >= 0 (0: pieces of step_tokens), got {self.step_ms}")
        for name in ("max_body_bytes", "max_json_bytes", "max_json_depth", "max_embedding_inputs",
                     "max_embedding_chars"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.header_timeout_s <= 0 or self.keep_alive_s <= 0 or self.max_connections < self.max_queue:
            raise ValueError("need header_timeout_s > 0, keep_alive_s > 0 and max_connections >= max_queue")
        if self.metrics_key is not None and len(self.metrics_key) < 8:
            raise ValueError("metrics_key must be at least 8 characters (e.g. openssl rand -hex 16)")
        for tenant in self.api_keys.values():
            validate_tenant(tenant)


def load_api_keys(path: Path) -> dict[str, str]:
    """Read an API keys file: one ``KEY TENANT [QUOTA=VALUE ...]`` line per key; blank lines and ``#`` comments skipped.

    >>> import tempfile, os
    >>> with tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False) as f:
    ...     _ = f.write("# team keys\\nsk-alpha alpha\\nsk-beta-1 beta\\n")
    >>> load_api_keys(Path(f.name))
    {'sk-alpha': 'alpha', 'sk-beta-1': 'beta'}
    >>> os.unlink(f.name)
    """
    keys: dict[str, str] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) < 2:
            raise ValueError(f"{path}:{n}: expected 'KEY TENANT [QUOTA=VALUE ...]', got {len(parts)} words")
        key, tenant = parts[:2]
        try:
            TenantQuota().with_words(parts[2:])
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from e
        if len(key) < 8:
            raise ValueError(f"{path}:{n}: API keys must be at least 8 characters (e.g. openssl rand -hex 16)")
        if key in keys:
            raise ValueError(f"{path}:{n}: key listed twice")
        keys[key] = validate_tenant(tenant)
    if not keys:
        raise ValueError(f"{path} lists no keys; write one 'KEY TENANT' pair per line")
    return keys


def load_tenant_quotas(path: Path, default: TenantQuota) -> dict[str, TenantQuota]:
    """The quotas a keys file sets: ``KEY TENANT requests_per_minute=60 concurrent=2 ...`` lines.

    Words after the tenant override ``default`` for that tenant; two keys of one tenant must agree.

    >>> import tempfile, os
    >>> with tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False) as f:
    ...     _ = f.write("sk-alpha-1 alpha concurrent=2\\nsk-beta-22 beta\\n")
    >>> load_tenant_quotas(Path(f.name), TenantQuota())["alpha"].concurrent
    2
    >>> os.unlink(f.name)
    """
    quotas: dict[str, TenantQuota] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if len(parts) < 3:
            continue
        quota = default.with_words(parts[2:])
        if quotas.setdefault(parts[1], quota) != quota:
            raise ValueError(f"{path}:{n}: tenant {parts[1]!r} has other quotas on an earlier line; make them agree")
    return quotas
