"""Headless Chromium for UI tests: Debian's ``chromium`` driven by Playwright.

Playwright never downloads a browser here (no ``playwright install``): it starts
``/usr/bin/chromium`` through ``executable_path``. Without Chromium or the playwright package
the tests skip with the reason shown, except under ``CI``, where they fail, so that CI cannot
skip them silently (``.ci/run`` installs Debian's ``chromium`` as root).

    require_chromium()                       # skip (or fail under CI) first
    with chromium_page(tmp_path / "profile") as page:
        page.goto(url)
        save_screenshot(page, tmp_path, "run-report")

Every Chromium process started with that profile directory is killed when the block ends,
also when a test failed in it. ``QO_OPS_UPDATE_SCREENSHOTS=1`` copies each screenshot to
``docs/screenshots/`` as well (those the README shows).
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from qo_ops_tests.conftest import REPO

if TYPE_CHECKING:
    from playwright.sync_api import Page

CHROMIUM = Path("/usr/bin/chromium")
# As root Chromium needs --no-sandbox; the rest keeps it off the (closed) network and quiet.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 800}
TIMEOUT_MS = 90_000  # two shared cores: the webserver answers slowly while runs start
SCREENSHOTS = REPO / "docs" / "screenshots"
UPDATE_ENV = "QO_OPS_UPDATE_SCREENSHOTS"


def _truthy_env(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def require_chromium() -> None:
    """Skip the test (fail it under CI) unless Chromium and Playwright are installed."""
    missing = []
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(
            f"{CHROMIUM} not found: install Debian's `chromium` package "
            "(`apt-get install chromium`; .ci/run does it as root)"
        )
    try:
        import PIL  # noqa: F401
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        missing.append(
            f"the {exc.name} package is missing: `.venv/bin/pip install -c constraints.txt "
            "-e '.[dev]'` (never `playwright install`: it drives Debian's Chromium)"
        )
    if missing:
        reason = "; ".join(missing) + " to run the browser tests"
        if _truthy_env("CI"):
            pytest.fail(f"{reason} (CI is set, so this does not skip)", pytrace=False)
        pytest.skip(reason)


def _processes_using(profile: Path) -> list[int]:
    """Ids of the processes whose command line names this profile directory."""
    marker = f"--user-data-dir={profile}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # ended meanwhile, or not ours to read
            continue
        if marker in cmdline:
            found.append(int(entry.name))
    return found


def _kill_chromium(profile: Path) -> None:
    for pid in _processes_using(profile):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextmanager
def chromium_page(profile: Path) -> Iterator[Page]:
    """A page of a headless Chromium with a fresh profile in ``profile`` (1280×800)."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=TIMEOUT_MS)
    profile.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as playwright:
            context = playwright.chromium.launch_persistent_context(
                str(profile),
                executable_path=str(CHROMIUM),
                headless=True,
                args=CHROMIUM_ARGS,
                viewport=VIEWPORT,  # type: ignore[arg-type]
                device_scale_factor=1,
                locale="en-US",
                timezone_id="UTC",
            )
            try:
                context.set_default_timeout(TIMEOUT_MS)
                page = context.pages[0] if context.pages else context.new_page()
                yield page
            finally:
                context.close()
    finally:
        _kill_chromium(profile)  # whatever Playwright could not close


def save_screenshot(page: Page, folder: Path, name: str, *, publish: bool = True) -> Path:
    """A PNG of the viewport in ``folder`` (and, if ``publish``, in docs/screenshots/ when
    asked to), in a 256-colour palette: a third of Chromium's size, the UI's flat colours
    survive it."""
    from PIL import Image

    path = folder / f"{name}.png"
    page.screenshot(path=str(path), animations="disabled", caret="hide")
    with Image.open(path) as shot:
        small = shot.convert("RGB").quantize(
            colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE
        )
    small.save(path, optimize=True)
    if publish and _truthy_env(UPDATE_ENV):
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, SCREENSHOTS / path.name)
    return path
