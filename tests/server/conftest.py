"""A real ``ragkv serve`` subprocess on a free loopback port, with a tiny random-weight model saved to disk."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import env_without_ragkv_settings, make_model, make_tokenizer

KEYS = {"sk-test-alpha-0001": "alpha", "sk-test-beta-00002": "beta"}
# RAGKV_TEST_SERVE_RAY=N: every real server these tests start is ``ragkv serve --ray --replicas N``
# (Ray Serve replicas behind the ingress), so the client tests run against the replicated server too
RAY_REPLICAS = int(os.environ.get("RAGKV_TEST_SERVE_RAY") or 0)
only_one_process = pytest.mark.skipif(RAY_REPLICAS > 0, reason="a property of one ragkv serve process")
APPLES = "Apples grow on trees in orchards, and farmers pick them in the autumn. " * 6
BOATS = "Boats float on water and carry people across lakes and along rivers. " * 6


@dataclass
class Served:
    """A running server: its base URL, data dir and process."""

    url: str
    data_dir: Path
    process: subprocess.Popen[bytes]
    log: Path

    def client(self, key: str | None = None, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-serve-model")
    tok = make_tokenizer()
    make_model("llama", len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def start_server(model_dir: Path, data_dir: Path, *args: str) -> Served:
    """Start ``ragkv serve`` and wait until /health answers.

    fp32, as ``load_model`` gives the tests' reference engines: ``auto`` would pick bf16 on a CPU with
    avx512_bf16, and the reference answers of the random-weight model differ from bf16 ones."""
    port = free_port()
    env = env_without_ragkv_settings()
    env.update(HF_HUB_OFFLINE="1", RAGKV_LOG="INFO")
    log = data_dir / "server.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "ragkv.cli", "serve", "--port", str(port), "--model", str(model_dir),
           "--data-dir", str(data_dir), "--max-new-tokens", "16", "--dtype", "float32", *args]  # fmt: skip
    if RAY_REPLICAS:
        cmd += ["--ray", "--replicas", str(RAY_REPLICAS)]
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + (600 if RAY_REPLICAS else 180)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ragkv serve exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return Served(url, data_dir, process, log)
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"ragkv serve did not start:\n{log.read_text()}")


def stop_server(served: Served) -> None:
    served.process.terminate()
    try:
        served.process.wait(90 if RAY_REPLICAS else 30)
    except subprocess.TimeoutExpired:
        served.process.kill()
        served.process.wait()


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[Served]:
    """A server without API keys (the default tenant), with two documents indexed."""
    served = start_server(tiny_model_dir, tmp_path_factory.mktemp("serve-data"), "--max-queue", "16")
    with served.client() as c:
        for source, text in (("mem:apples", APPLES), ("mem:boats", BOATS)):
            r = c.post("/v1/documents", json={"source": source, "text": text})
            assert r.status_code == 201, r.text
    yield served
    stop_server(served)


@pytest.fixture(scope="session")
def keyed_server(tiny_model_dir, tmp_path_factory) -> Iterator[Served]:
    """A server with an API keys file mapping two keys to tenants alpha and beta."""
    data = tmp_path_factory.mktemp("serve-keyed")
    keys = data / "keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for k, t in KEYS.items()))
    served = start_server(tiny_model_dir, data / "d", "--api-keys", str(keys), "--max-batch", "1", "--max-queue", "1")
    yield served
    stop_server(served)


@pytest.fixture
def make_client(llama_adapter, tmp_path) -> Iterator[Any]:
    """``make_client(**settings)``: a TestClient on an in-process app (tiny llama, hashing embedder);
    ``engine={...}`` overrides fields of its ``EngineConfig``.

    The app runs its lifespan (so its scheduler thread) while the client is open; every client made
    is closed at the end of the test. ``base_url`` is a loopback name, as a local client sends.
    """
    from fastapi.testclient import TestClient

    from ragkv.engine import EngineConfig, RagKV
    from ragkv.generation import GenerationConfig
    from ragkv.retriever.embedder import HashingEmbedder
    from ragkv.server.app import create_app
    from ragkv.server.settings import ServerSettings

    opened: list[Any] = []

    def make(*, engine: dict[str, Any] | None = None, **settings: Any) -> Any:
        data = tmp_path / f"engine-{len(opened)}"
        cfg = EngineConfig(
            data_dir=data,
            store=("memory://", str(data / "kv")),
            generation=GenerationConfig(max_new_tokens=8),
            **(engine or {}),
        )
        rag = RagKV(cfg, adapter=llama_adapter, embedder=HashingEmbedder(dim=64))
        client = TestClient(create_app(rag, ServerSettings(**settings)), base_url="http://127.0.0.1")
        opened.append(client.__enter__())
        return client

    yield make
    for client in opened:
        client.__exit__(None, None, None)
