"""The Dockerfile, built and run: ``deploy/image/build.sh`` (``make image``) makes the image,
and podman runs it as Kubernetes would, with no Docker daemon anywhere. The base is the
Dockerfile's own where a registry serves it, otherwise the Debian stand-in the script makes
(docs/deploy.md, "What CI proves"). Skips visibly where buildah/podman cannot run; fails
under ``CI``."""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest

from qo_ops_tests.deploy.cluster.containers import PODMAN_ALONE, Image, remove_containers
from qo_ops_tests.deploy.files import dockerfile

# one worker builds the image once for both image test files (make test runs pytest-xdist)
pytestmark = pytest.mark.xdist_group("image")

PRUNED = ("pandas/tests", "numpy/_core/tests", "pyarrow/tests", "pyarrow/include")
DEV_ONLY = ("pytest", "ruff", "mypy", "hypothesis", "kmock", "playwright", "kubernetes_validate")
# pgserver: the embedded PostgreSQL, which a pod must never start in place of its database;
# qo_ops_tests: the tests, with the emulator and kubelet scaffolding, never shipped
LEFT_OUT = (*DEV_ONLY, "pgserver", "qo_ops_tests")


def _inspect(image: Image) -> dict:
    inspect = subprocess.run(
        ["podman", "image", "inspect", image.name], capture_output=True, text=True, check=True
    )
    return json.loads(inspect.stdout)[0]


def test_the_image_builds_and_says_its_size(image: Image, capsys):
    with capsys.disabled():  # the figure docs/deploy.md quotes, read off every CI run
        print(f"\nimage: {image.name} is {image.size_bytes / 1e6:.0f} MB")
    config = _inspect(image)["Config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["/opt/qo-ops/bin/dumb-init", "--"]
    assert config["Cmd"] == dockerfile().in_stage(-1, "CMD")[-1].exec_form()
    assert _inspect(image)["Healthcheck"]["Test"][0] == "CMD"  # kept: built in docker format


def test_the_code_location_imports_inside_it_as_its_own_user(image: Image):
    done = image.run(
        "python",
        "-c",
        "import os, qo_ops.definitions as d; print(os.getuid(), os.getgid(), type(d.defs).__name__)",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["10001", "10001", "Definitions"]


def test_it_carries_no_build_tools_no_dev_extras_and_no_bundled_test_suites(image: Image):
    probe = (
        "import importlib.util as u, pathlib, shutil, sys\n"
        f"print([m for m in {LEFT_OUT!r} if u.find_spec(m)])\n"
        "print([t for t in ('gcc', 'cc', 'make', 'pip', 'pip3') if shutil.which(t)])\n"
        "site = pathlib.Path(sys.prefix, 'lib', 'python3.11', 'site-packages')\n"
        f"print([p for p in {PRUNED!r} if (site / p).exists()])\n"
        "print((site / 'pandas').is_dir() and (site / 'pyarrow').is_dir())\n"
    )
    done = image.run("python", "-c", probe)
    assert done.returncode == 0, done.stderr[-3000:]
    dev, tools, unpruned, present = done.stdout.splitlines()
    assert (dev, tools, unpruned) == ("[]", "[]", "[]")
    assert present == "True"  # the prune took the tests, not the packages


def test_without_a_database_url_it_stops_with_one_line_instead_of_an_embedded_server(image):
    done = image.run("qo-ops", "db", "upgrade")  # no QO_OPS_DATABASE_URL, no pgserver inside
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "qo-ops: error: QO_OPS_DATABASE_URL is not set, and this installation has no embedded "
        "PostgreSQL (the pgserver package): set it to your server's URL"
    ]


def test_its_default_command_passes_its_own_health_check(image: Image):
    name = f"qo-ops-test-code-{uuid.uuid4().hex[:8]}"
    # the default command as it stands: dumb-init, then `dagster api grpc … -p 3030`, on the
    # container's own loopback (the health check runs inside it too), so no host port is used
    subprocess.run(
        [*PODMAN_ALONE, "-d", "--name", name, image.name], check=True, capture_output=True
    )
    probe = ["podman", "exec", name, *_inspect(image)["Healthcheck"]["Test"][1:]]
    try:
        end = time.monotonic() + 120
        while True:
            checked = subprocess.run(probe, capture_output=True, text=True)
            if checked.returncode == 0:
                break
            running = subprocess.run(
                ["podman", "inspect", "--format", "{{.State.Running}}", name],
                capture_output=True,
                text=True,
            ).stdout.strip()
            if running != "true" or time.monotonic() > end:
                logs = subprocess.run(["podman", "logs", name], capture_output=True, text=True)
                pytest.fail(
                    f"the code server is not healthy:\n{(logs.stdout + logs.stderr)[-3000:]}"
                )
            time.sleep(1)
        top = subprocess.run(["podman", "top", name, "pid", "args"], capture_output=True, text=True)
        assert "dumb-init" in top.stdout.splitlines()[1], top.stdout  # PID 1 is the init
    finally:
        remove_containers(name)
