"""Test scaffolding, never shipped: the image, built and run on this machine without a
Docker daemon (buildah builds it, podman runs it).

``deploy/image/build.sh`` builds it, as ``make image`` does: on the real base where a registry
serves it, otherwise on the Debian stand-in base it makes with mmdebstrap. Containers run with
runc (crun fails on this kernel's cgroups), ulimits podman is allowed to set here, no health
check timers (they need systemd) and the host's network, so a container reaches the
emulator, PostgreSQL and the code location on 127.0.0.1 as a pod reaches cluster services.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from dataclasses import dataclass

import pytest

from qo_ops_tests.deploy.files import REPO, truthy_env

BUILD = REPO / "deploy" / "image" / "build.sh"
TOOLS = ("buildah", "podman", "runc")
INSTALL = "apt-get install buildah podman runc mmdebstrap (.ci/run installs them)"


def _ulimit(kind: int, wanted: int = 4096) -> str:
    """podman's default limits exceed what this sandbox may set (``setrlimit … Operation not
    permitted``): ask for ``wanted``, or the hard limit this process has when it is lower."""
    hard = resource.getrlimit(kind)[1]
    value = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    return f"{value}:{value}"


PODMAN = [
    "podman",
    "run",
    "--runtime",
    "runc",
    "--ulimit",
    f"nofile={_ulimit(resource.RLIMIT_NOFILE)}",
    "--ulimit",
    f"nproc={_ulimit(resource.RLIMIT_NPROC)}",
    "--no-healthcheck",
]
PODMAN_RUN = [*PODMAN, "--network", "host"]  # as a pod reaches cluster services
PODMAN_ALONE = [*PODMAN, "--network", "none"]  # its own loopback only: no port of the host


def require_builder() -> None:
    """Skip, visibly, where the image cannot be built here; fail instead under CI."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    problem = f"{', '.join(missing)} not installed ({INSTALL})" if missing else None
    if problem is None and os.geteuid() != 0:
        problem = "building and running images here needs root (rootless podman is not set up)"
    if problem is None:
        return
    if truthy_env("CI"):
        pytest.fail(problem)
    pytest.skip(problem)


@dataclass(frozen=True)
class Image:
    name: str
    size_bytes: int

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """``podman run --rm`` of this image with ``args`` (after its ENTRYPOINT, the init)."""
        return subprocess.run(
            [*PODMAN_RUN, "--rm", self.name, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def build_image(name: str) -> Image:
    """Build the Dockerfile as ``make image`` does and return the image."""
    done = subprocess.run(
        [str(BUILD), name], cwd=REPO, capture_output=True, text=True, timeout=1800
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"the image did not build:\n{output[-6000:]}"
    size = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Size}}", name],
        capture_output=True,
        text=True,
        check=True,
    )
    return Image(name, int(size.stdout.strip()))


def remove_containers(prefix: str) -> None:
    """Remove every container whose name starts with ``prefix`` (running or not)."""
    names = subprocess.run(
        ["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True
    ).stdout.split()
    doomed = [n for n in names if n.startswith(prefix)]
    if doomed:
        subprocess.run(["podman", "rm", "-f", "-t", "0", *doomed], capture_output=True)


def image_tag() -> str:
    """A tag for this checkout's image: its commit, and ``-dirty`` for uncommitted changes."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True)
    return f"localhost/qo-ops:test-{head or 'dev'}{'-dirty' if dirty.stdout else ''}"
