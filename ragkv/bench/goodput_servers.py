"""The two servers ``ragkv bench goodput`` compares, as subprocesses on loopback ports.

``ragkv serve`` runs with its defaults on a temporary data directory; ``llama-server`` (llama.cpp,
built by ``tools/build_llama_server.sh``) runs with the settings that suit a RAG trace best:

- ``--parallel N`` slots with ``--cont-batching``: N requests prefill and decode together, the way
  ragkv's scheduler batches (N = ragkv's ``--max-batch`` default would be 8; 4 slots keep each
  slot's share of a 2-core machine useful, and the bench takes ``--parallel``).
- ``-c ctx * N``: llama-server splits its context among its slots, so each slot gets the same
  context per request as ragkv.
- ``cache_prompt: true`` in every request (the default in recent builds, sent anyway): a slot keeps
  its last prompt's KV cache and reuses the longest common prefix of the next prompt.
- ``--cache-reuse 256``: beyond the common prefix, runs of at least 256 tokens of the slot's cached
  prompt that recur at other positions are shifted there (RoPE shift) instead of recomputed; this
  is what lets llama.cpp reuse a chunk that moved, and 256 tokens is about half a chunk of the
  trace (a shorter N matches runs inside chunks and questions too often to pay off).
- ``--jinja``: the GGUF's own chat template, as ragkv renders it (the same prompt text becomes
  the same tokens).

Both get the same GGUF file and thread count. A server that does not answer its health check in
time, or exits, raises :class:`ServerStartError` with the last lines of its log.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

__all__ = [
    "BUILD_SCRIPT",
    "DEFAULT_BUILD",
    "LlamaServerMissingError",
    "ServerProcess",
    "ServerSpec",
    "ServerStartError",
    "find_llama_server",
    "free_port",
    "llama_server_spec",
    "ragkv_serve_spec",
    "wait_all_ready",
]

BUILD_SCRIPT = "tools/build_llama_server.sh"
DEFAULT_BUILD = Path("~/.cache/ragkv/llama-server/bin/llama-server")  # where the build script puts it
CACHE_REUSE = 256


class LlamaServerMissingError(RuntimeError):
    """No llama-server binary was found (the message says how to build one)."""


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy; the message holds the last lines of its log."""


def find_llama_server(explicit: str | None = None) -> Path:
    """The llama-server binary: ``explicit``, else ``RAGKV_LLAMA_SERVER``, else PATH, else the build script's folder.

    Raises:
        LlamaServerMissingError: If none of them names an executable file.
    """
    for given, what in ((explicit, "--llama-server"), (os.environ.get("RAGKV_LLAMA_SERVER"), "RAGKV_LLAMA_SERVER")):
        if given:
            path = Path(given).expanduser()
            if path.is_file() and os.access(path, os.X_OK):
                return path
            raise LlamaServerMissingError(
                f"{what} names {given}, which is not an executable file; build llama-server with  "
                f"bash {BUILD_SCRIPT}  (it prints the binary's path)"
            )
    found = shutil.which("llama-server")
    if found:
        return Path(found)
    built = DEFAULT_BUILD.expanduser()
    if built.is_file() and os.access(built, os.X_OK):
        return built
    raise LlamaServerMissingError(
        f"llama-server not found (--llama-server, RAGKV_LLAMA_SERVER, PATH, {DEFAULT_BUILD}); build it from the "
        f"llama.cpp sources llama-cpp-python vendors with  bash {BUILD_SCRIPT}  and pass the path it prints"
    )


def free_port() -> int:
    """A loopback TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """How to start one server and know it is ready."""

    name: str  # shown in tables: "ragkv" or "llama-server"
    command: tuple[str, ...]
    port: int
    env: Mapping[str, str] = field(default_factory=dict)  # added to this process's environment
    extra_body: Mapping[str, object] = field(default_factory=dict)  # sent with every chat request

    @property
    def url(self) -> str:
        """The server's base URL (no /v1)."""
        return f"http://127.0.0.1:{self.port}"


def ragkv_serve_spec(model: str, threads: int, data_dir: Path, max_tokens: int) -> ServerSpec:
    """``ragkv serve`` with its defaults on ``data_dir``; the answer cap raised to ``max_tokens`` if needed."""
    port = free_port()
    command = [sys.executable, "-m", "ragkv.cli", "serve", "--model", model, "--port", str(port)]
    command += ["--data-dir", str(data_dir), "--max-new-tokens", str(max(128, max_tokens))]
    # ragkv retrieves nothing here: the trace carries the chunks, its prompt matcher finds them.
    return ServerSpec("ragkv", tuple(command), port, {"RAGKV_THREADS": str(threads)}, {"ragkv": {"retrieve": False}})


def llama_server_spec(
    binary: Path, gguf: Path, threads: int, context: int, parallel: int, cache_reuse: int = CACHE_REUSE
) -> ServerSpec:
    """llama-server on ``gguf`` with ``parallel`` slots of ``context`` tokens each (see the module docstring)."""
    port = free_port()
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    command += ["-t", str(threads), "-tb", str(threads), "-c", str(context * parallel), "-np", str(parallel)]
    command += ["-cb", "--cache-reuse", str(cache_reuse), "--jinja", "-ngl", "0"]
    return ServerSpec("llama-server", tuple(command), port, {"OMP_WAIT_POLICY": "PASSIVE"}, {"cache_prompt": True})


class ServerProcess:
    """A started server: its process and log file; a context manager that stops it."""

    def __init__(self, spec: ServerSpec, log: Path) -> None:
        self.spec = spec
        self.log = log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(  # noqa: S603 - our own argv, no shell
            spec.command, stdout=self._out, stderr=subprocess.STDOUT, env={**os.environ, **spec.env}
        )

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server's log."""
        self._out.flush()
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def failure(self, why: str) -> ServerStartError:
        """A :class:`ServerStartError` saying ``why``, with the command and the log's last lines."""
        return ServerStartError(
            f"{self.spec.name} {why}\ncommand: {' '.join(self.spec.command)}\nlast lines of its log ({self.log}):\n"
            f"{self.tail()}"
        )

    def poll_ready(self) -> bool:
        """True once GET /health answers 200; raises :class:`ServerStartError` when the process exited."""
        import httpx

        if self.proc.poll() is not None:
            raise self.failure(f"exited with status {self.proc.returncode}")
        try:
            return httpx.get(f"{self.spec.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """Terminate the server (kill it after 20 s) and close its log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def wait_all_ready(servers: Sequence[ServerProcess], timeout_s: float) -> None:
    """Wait until every server is healthy; raise the first one's :class:`ServerStartError` otherwise."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        pending = [s for s in pending if not s.poll_ready()]
        if pending and time.monotonic() > deadline:
            raise pending[0].failure(f"did not answer GET /health with 200 within {timeout_s:.0f} s")
        if pending:
            time.sleep(1.0)
