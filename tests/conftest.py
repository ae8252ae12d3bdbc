"""Shared fixtures: the real default model, loaded once, through real llama.cpp."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edgeinfer import Engine
from edgeinfer.backends.vulkan_driver import physical_devices
from edgeinfer.models.catalog import DEFAULT_MODEL, resolve_model

# llama.cpp lists a Vulkan device that runs on the CPU (Mesa's lavapipe, which `scripts/setup.sh --vulkan`
# installs) only where this names it. The suite lists lavapipe alone: the vulkan backend's tests and the
# conformance suite run there, and auto, which passes it over, runs every other test on the CPU as it would
# without Vulkan. A real GPU is hidden too; set GGML_VK_VISIBLE_DEVICES yourself to run the suite on one.
if "GGML_VK_VISIBLE_DEVICES" not in os.environ:
    on_cpu = [str(i) for i, device in enumerate(physical_devices()) if device.on_cpu]
    os.environ["GGML_VK_VISIBLE_DEVICES"] = ",".join(on_cpu[:1])


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # The native-build probe verdict goes to a cache dir; keep the tests' own.
    mp = pytest.MonkeyPatch()
    mp.setenv("EDGEINFER_CACHE_DIR", str(tmp_path_factory.mktemp("edgeinfer-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def model_path() -> Path:
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def engine(model_path: Path) -> Engine:
    """One engine for the read-mostly tests; tests that change its settings make their own."""
    with Engine(model_path, kv_budget="2048tok", threads=2) as e:
        yield e
