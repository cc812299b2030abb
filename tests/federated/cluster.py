"""Flower's deployment engine on loopback for the tests: one SuperLink and SuperNodes as subprocesses
(Flower's own commands), and ``flwr run`` against them. Every process is ended by :meth:`close`."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

APP = Path(__file__).parent / "app"
BIN = Path(sys.executable).parent  # flower-superlink, flower-supernode, flower-superexec, flwr
SRC = Path(__file__).resolve().parents[2] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, log: Path, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"port {port} not open after {seconds} s:\n{log.read_text()[-3000:]}")


class Cluster:
    """A SuperLink and ``nodes`` SuperNodes (partition ``i`` of ``nodes``) under ``root``."""

    def __init__(self, root: Path, nodes: int, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.home = root / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        self.env.update(
            HOME=str(self.home),
            PATH=f"{BIN}{os.pathsep}{self.env.get('PATH', '')}",
            PYTHONPATH=os.pathsep.join(p for p in (str(SRC), self.env.get("PYTHONPATH", "")) if p),
            OMP_NUM_THREADS="1",
        )
        self.procs: list[subprocess.Popen] = []
        self.nodes: list[subprocess.Popen] = []
        self.port = free_port()
        flwr = self.home / ".flwr"
        flwr.mkdir(exist_ok=True)
        (flwr / "config.toml").write_text(
            f'[superlink]\ndefault = "test"\n\n[superlink.test]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        self.link = self._start(
            "superlink",
            [
                "flower-superlink",
                "--insecure",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
                "--database",
                str(root / "state.db"),
            ],
        )
        _wait_port(self.port, self.link, root / "superlink.log")
        node_env = dict(self.env, **(env or {}))
        for i in range(nodes):
            self.add_node(i, nodes, node_env)

    def _start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            cmd,
            cwd=self.root,
            env=env or self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: close() ends its children too
        )
        proc.log = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def add_node(self, i: int, n: int, env: dict[str, str] | None = None) -> subprocess.Popen:
        port = free_port()
        proc = self._start(
            f"node{i}",
            [
                "flower-supernode",
                "--insecure",
                "--superlink",
                f"127.0.0.1:{self.port}",
                "--port",
                str(port),
                "--node-config",
                f"partition-id={i} num-partitions={n}",
            ],
            env,
        )
        self.nodes.append(proc)
        return proc

    def run(
        self, config: dict[str, object], timeout: float = 180, app: Path = APP
    ) -> subprocess.CompletedProcess:
        """``flwr run`` of ``app`` (the test app) with ``config`` as its run config, streamed to the end."""
        items = " ".join(f"{k}={_toml(v)}" for k, v in config.items())
        return subprocess.run(
            [str(BIN / "flwr"), "run", str(app), "test", "--stream", "--run-config", items],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL ``proc`` and every process it started."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill(proc)
            proc.log.close()  # type: ignore[attr-defined]
        for proc in self.procs:  # the process groups' children (flwr-clientapp, flwr-serverapp...)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()}" for p in sorted(self.root.glob("*.log")))


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)
