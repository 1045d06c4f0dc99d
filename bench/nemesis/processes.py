"""The ``qo-ops run`` processes the nemesis starts: each a real process with its own output
files, which it signals, waits for and reads the summary of."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from bench.common import QO_OPS
from qo_ops.platform.job.scope import Scope

SKIPPED_EXIT = 4  # `qo-ops run`: the lease is held elsewhere


@dataclass(frozen=True)
class RunTarget:
    """A job over one scope, as ``qo-ops run`` is asked for it."""

    job: str
    tenant: str
    window: tuple[date, date] | None  # a windowed job's first and last day

    @property
    def scope(self) -> str:
        """The scope key its ``job_run`` rows and lease carry."""
        if self.window is None:
            return Scope(self.tenant).key
        return Scope.days(self.tenant, *self.window).key

    def __str__(self) -> str:
        return f"{self.job} {self.scope}"


@dataclass(frozen=True)
class RunLimits:
    """The options a run is started with (the lease TTL is the nemesis's small one)."""

    lease_ttl_s: int
    batch_size: int | None = None
    throttle_ms: int | None = None


@dataclass
class RunProcess:
    """One ``qo-ops run … --mode execute --json`` process: what it runs, why the nemesis
    started it, where its output goes, and what was done to it."""

    target: RunTarget
    why: str  # planned, rival, schedule, rerun, final
    process: subprocess.Popen[bytes]
    out: Path
    started: float  # monotonic
    frozen: bool = False  # SIGSTOPped and not yet continued
    signals: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()

    def send(self, sig: signal.Signals) -> bool:
        """Send ``sig``; False when the process had already ended."""
        if not self.alive():
            return False
        with suppress(ProcessLookupError):
            os.kill(self.pid, sig)
            self.signals.append(sig.name)
            if sig in (signal.SIGSTOP, signal.SIGCONT):
                self.frozen = sig is signal.SIGSTOP
            return True
        return False

    def wait(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` for the process to end; its exit code, or None."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """End it for good (SIGKILL ends a frozen process too)."""
        if self.alive():
            self.send(signal.SIGKILL)
            self.process.wait(timeout=30)

    def summary(self) -> dict[str, Any] | None:
        """The run's summary (``--json``), when it printed one."""
        try:
            text = self.out.read_text().strip()
        except OSError:
            return None
        if not text.startswith("{"):
            return None
        try:
            data: dict[str, Any] = json.loads(text)
        except ValueError:
            return None
        return data


class Launcher:
    """Starts ``qo-ops run`` processes with the world's environment, each with its output
    in a file of its own under ``logs``."""

    def __init__(self, env: dict[str, str], logs: Path, approvals: dict[str, str]) -> None:
        self.env, self.logs, self.approvals = env, logs, approvals
        self.logs.mkdir(parents=True, exist_ok=True)
        self.started: list[RunProcess] = []

    def start(
        self, target: RunTarget, limits: RunLimits, why: str, reason: str, iteration: int = 0
    ) -> RunProcess:
        """Start an execute of ``target`` (a person's: it gives a reason, it is audited); its
        output files are named by order, iteration (0: the final pass), job and why."""
        command = [QO_OPS, "run", target.job, "--tenant", target.tenant, "--mode", "execute"]
        command += ["--reason", reason, "--lease-ttl-s", str(limits.lease_ttl_s), "--json"]
        if target.job in self.approvals:  # a destructive job's execute cites its approval
            command += ["--approval", self.approvals[target.job]]
        if target.window is not None:
            first, last = target.window
            command += ["--from", first.isoformat(), "--to", last.isoformat()]
        if limits.batch_size is not None:
            command += ["--batch-size", str(limits.batch_size)]
        if limits.throttle_ms is not None:
            command += ["--throttle-ms", str(limits.throttle_ms)]
        name = f"{len(self.started):05d}-i{iteration:03d}-{target.job}-{why}"
        out = self.logs / f"{name}.json"
        with out.open("wb") as stdout, (self.logs / f"{name}.err").open("wb") as stderr:
            process = subprocess.Popen(
                command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,  # the harness's terminal's Ctrl-C is no fault of the plan
            )
        run = RunProcess(target, why, process, out, time.monotonic())
        self.started.append(run)
        return run

    def alive(self) -> list[RunProcess]:
        """The processes still running (frozen ones included)."""
        return [r for r in self.started if r.alive()]

    def stop_all(self) -> None:
        """End every process still running (the harness is leaving)."""
        for run in self.alive():
            run.kill()
