"""A kernel-limited link for benchmarks: a private network namespace whose loopback a ``tbf`` qdisc slows.

The process re-executes itself under ``unshare -n`` (root, or a user namespace with CAP_NET_ADMIN);
inside, loopback is brought up with a 1500-byte MTU (so no packet exceeds the token bucket) and
:func:`set_rate` installs or changes ``tbf`` on ``lo``. ``netem`` is not available on this machine
kind, so only bandwidth is limited: round-trip latency stays loopback's.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["INSIDE_ENV", "inside", "namespace_problem", "reexec_inside", "set_rate", "start_redis"]

INSIDE_ENV = "RAGKV_BENCH_NETNS"  # set in the re-executed process


def inside() -> bool:
    """Whether this process runs in the namespace :func:`reexec_inside` made."""
    return os.environ.get(INSIDE_ENV) == "1"


def namespace_problem() -> str | None:
    """Why a rate-limited namespace cannot be made here, or None when it can."""
    for tool in ("unshare", "ip", "tc", "redis-server"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install util-linux iproute2 redis-server)"
    probe = subprocess.run(
        [
            "unshare",
            "-n",
            "sh",
            "-c",
            "ip link set lo up && tc qdisc add dev lo root tbf rate 10mbit burst 32kbit latency 400ms",
        ],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"cannot create a rate-limited network namespace (needs root): {probe.stderr.strip()[:200]}"
    return None


def reexec_inside(argv: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run ``python argv...`` in a new network namespace with loopback up; return its exit code."""
    problem = namespace_problem()
    if problem:
        raise RuntimeError(problem)
    child_env = {**os.environ, **(env or {}), INSIDE_ENV: "1"}
    script = 'ip link set lo mtu 1500 && ip link set lo up && exec "$@"'
    cmd = ["unshare", "-n", "sh", "-c", script, "sh", sys.executable, *argv]
    return subprocess.run(cmd, env=child_env).returncode


def set_rate(mbit: float | None) -> None:
    """Limit loopback to ``mbit`` Mbit/s (None: unlimited); call inside the namespace."""
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    if mbit is None:
        return
    change_rate(mbit, add=True)


def change_rate(mbit: float, *, add: bool = False) -> None:
    """Change the rate of the installed ``tbf`` (``tc qdisc change``), mid-transfer if need be."""
    # the bucket holds at least 32 kbit and 4 ms of traffic: at 1 Gbit/s a 4 KB bucket cannot refill fast enough
    burst = max(4096, int(mbit * 1e6 / 8 * 0.004))
    subprocess.run(
        [
            "tc",
            "qdisc",
            "add" if add else "change",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            f"{mbit}mbit",
            "burst",
            str(burst),
            "latency",
            "400ms",
        ],
        check=True,
        capture_output=True,
    )


def start_redis(workdir: Path, port: int = 6399) -> subprocess.Popen[bytes]:
    """A redis-server on 127.0.0.1:``port`` (no persistence), ready to answer."""
    proc = subprocess.Popen(
        [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"redis-server did not start on port {port}")
