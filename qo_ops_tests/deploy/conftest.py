"""The image, built once per session for the tests that run it (``make image``'s way)."""

from __future__ import annotations

import pytest

from qo_ops_tests.deploy.cluster.containers import Image, build_image, image_tag, require_builder


@pytest.fixture(scope="session")
def image() -> Image:
    require_builder()
    return build_image(image_tag())
