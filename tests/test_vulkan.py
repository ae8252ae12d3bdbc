"""The vulkan backend on a real Vulkan device: Mesa's lavapipe where no GPU is (``scripts/setup.sh --vulkan``
installs it; conftest.py makes llama.cpp list it), a GPU where one is.

What it shares with the llama.cpp backend (agreement, cache operations, errors) is the conformance suite's; here
is what is its own: where the layers go, the device's memory, auto's choice, the device list, and faults.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_model import write_tiny_gguf

from edgeinfer import BackendError, BackendUnavailableError, Engine, InsufficientMemoryError, InvalidOptionError
from edgeinfer.backends import backend_class, choose_backend
from edgeinfer.backends.base import CPU, BackendOptions, check_options, compute_bytes
from edgeinfer.cli import cli
from edgeinfer.models.info import load_model_info
from edgeinfer.system import check_memory

try:
    VulkanBackend = backend_class("vulkan")
except BackendUnavailableError as exc:
    pytest.skip(f"the vulkan backend cannot run here: {exc}", allow_module_level=True)

from edgeinfer.backends.vulkan_driver import physical_devices  # noqa: E402 - after the skip

GPU = VulkanBackend._default()  # where it runs unless told: its first real GPU, else lavapipe
MIB = 2**20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A context long enough for a cache layer larger than a device binds at once (a test below asks for one): 16M
    # tokens of 512 bytes a layer's keys (two KV heads of 64, f32) take 8 GiB.
    path = tmp_path_factory.mktemp("placement") / "tiny.gguf"
    return write_tiny_gguf(path, n_layer=3, n_head_kv=2, n_ctx=1 << 24)


def buffer_mib(lines: list[str], where: str, what: str) -> float:
    """The size llama.cpp logged for its ``where`` (``Vulkan0``, ``CPU``, ``CPU_Mapped``) ``what`` buffer, in MiB."""
    pattern = re.compile(rf"\b{re.escape(where)} {what} buffer size = +([0-9.]+) MiB")
    return sum(float(m[1]) for line in lines if (m := pattern.search(line)))


@pytest.fixture
def llama_log(caplog: pytest.LogCaptureFixture) -> Callable[[], AbstractContextManager[list[str]]]:
    """``with llama_log() as lines``: llama.cpp's log lines meanwhile, in ``lines`` at the end (the backend passes
    them to its logger at DEBUG)."""

    @contextmanager
    def capture() -> Iterator[list[str]]:
        caplog.clear()
        lines: list[str] = []
        with caplog.at_level(logging.DEBUG, logger="edgeinfer.llamacpp"):
            yield lines
        lines.extend(r.getMessage() for r in caplog.records if r.name == "edgeinfer.llamacpp")

    return capture


def test_every_layer_goes_to_the_device_by_default_and_gpu_layers_keeps_the_rest_on_the_cpu(tiny, llama_log):
    """And the memory check counts what llama.cpp puts where: its weights and its cache, on each side."""
    info = load_model_info(tiny)
    device = GPU.name.capitalize()  # llama.cpp's name for its buffers: Vulkan0
    for layers, placed in ((-1, "offloaded 4/4 layers"), (2, "offloaded 2/4 layers")):
        options = BackendOptions(kv_tokens=256, gpu_layers=layers)
        need = VulkanBackend.memory(info, options)
        with llama_log() as lines, Engine(tiny, backend="vulkan", gpu_layers=layers, kv_budget="256tok") as engine:
            result = engine.generate("the lighthouse", max_tokens=8, temperature=0.0, ignore_eos=True)
        assert len(result.tokens) == 8 and result.metrics.kv_used == result.metrics.prompt_tokens + 7
        assert any(placed in line for line in lines), [line for line in lines if "offload" in line]
        on_device = buffer_mib(lines, device, "model") + buffer_mib(lines, device, "KV")
        assert on_device > 0
        counted = (need.device_bytes - compute_bytes(info, options)) / MIB
        assert counted == pytest.approx(on_device, abs=0.02), (layers, counted, on_device)
        on_host = buffer_mib(lines, "CPU_Mapped", "model") + buffer_mib(lines, "CPU", "KV")
        assert (need.weights + need.kv) / MIB == pytest.approx(on_host, abs=0.02), (layers, need, on_host)


def test_the_cpu_backend_of_the_same_build_gives_the_device_nothing(tiny, llama_log):
    """llama-cpp-python's defaults would offload every layer of a Vulkan build, and with none offloaded llama.cpp
    still used the device for a prompt's products; the llama.cpp backend gives it no device at all."""
    with llama_log() as lines, Engine(tiny, backend="llamacpp", kv_budget="256tok") as engine:
        engine.generate("the lighthouse " * 40, max_tokens=4, temperature=0.0)  # a prompt batch, where it would
    # ggml names the device's buffers Vulkan0 and Vulkan_Host; "ggml_vulkan:" lines are its start, listing devices.
    mentions = [line for line in lines if "Vulkan" in line and not line.startswith("ggml_vulkan:")]
    assert not mentions, mentions
    assert any("offloaded 0/4 layers" in line for line in lines)


def test_the_device_answers_as_the_cpu_does(tiny):
    prompt = "the lighthouse keeper"
    answers = {}
    for backend in ("vulkan", "llamacpp"):
        with Engine(tiny, backend=backend, kv_budget="256tok", kv_type="f32") as engine:
            answers[backend] = engine.logits(engine.tokenize(prompt))
    difference = abs(answers["vulkan"] - answers["llamacpp"]).max()
    assert difference < 0.05 * abs(answers["llamacpp"]).max(), difference


def test_a_device_by_index_or_by_name_and_an_unknown_one_in_one_line():
    options = BackendOptions(kv_tokens=256)
    assert check_options(VulkanBackend, dataclasses.replace(options, device="0")).device == GPU.name
    assert check_options(VulkanBackend, dataclasses.replace(options, device=GPU.name)).device == GPU.name
    for wrong in ("vulkan9", "9"):
        with pytest.raises(InvalidOptionError) as exc:
            check_options(VulkanBackend, dataclasses.replace(options, device=wrong))
        assert GPU.name in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(InvalidOptionError, match="puts nothing on"):
        check_options(VulkanBackend, dataclasses.replace(options, gpu_layers=0))
    # The llama.cpp backend serves the CPU (and CUDA or Metal GPUs), not the Vulkan devices.
    assert GPU.name not in [d.name for d in backend_class("llamacpp").devices()]


def test_a_device_too_small_for_the_layers_is_refused_in_one_line_with_the_sizes(tiny):
    whole = VulkanBackend.memory(load_model_info(tiny), BackendOptions(kv_tokens=1024))
    assert whole.device == GPU.name and whole.kv == 0
    small = dataclasses.replace(whole, device_free=whole.device_bytes // 2)
    with pytest.raises(InsufficientMemoryError) as exc:
        check_memory(small, force=False)
    assert GPU.name in str(exc.value) and "--gpu-layers" in str(exc.value) and "\n" not in str(exc.value)


def test_a_cache_layer_larger_than_the_device_binds_is_refused_before_loading(tiny):
    """A layer's keys beyond the device's storage-buffer range abort llama.cpp (lavapipe's is 128 MiB): refused in
    one line instead, even forced, and nothing is loaded."""
    info = load_model_info(tiny)
    assert GPU.max_tensor_bytes is not None, "the Vulkan driver was not asked"
    per_layer = VulkanBackend.kv_bytes_per_token(info, "f32") / (2 * info.hparams.n_layer)
    tokens = int(GPU.max_tensor_bytes / per_layer) + 2 * VulkanBackend.kv_block  # just past it
    assert tokens <= info.hparams.n_ctx_train, f"{GPU.name} binds {GPU.max_tensor_bytes / MIB:,.0f} MiB"
    with pytest.raises(BackendError) as exc:
        Engine(tiny, backend="vulkan", kv_budget=f"{tokens}tok", kv_type="f32", force=True)
    assert "--kv-budget" in str(exc.value) and "--backend llamacpp" in str(exc.value) and "\n" not in str(exc.value)


def test_auto_passes_over_a_device_emulated_on_the_cpu_and_one_the_model_and_its_cache_do_not_fit(tiny, caplog):
    """Emulation is the driver's own device type, which the backend asks the Vulkan loader for."""
    info = load_model_info(tiny)
    (driver,) = [device for device in physical_devices() if device.name == GPU.description]
    assert GPU.emulated == driver.on_cpu and GPU.max_tensor_bytes == driver.storage_range
    assert choose_backend("auto", info).name == ("llamacpp" if GPU.emulated else "vulkan")

    def asking(tokens: int) -> Callable[[type], BackendOptions]:
        """Options naming the device (so that an emulated one counts), with a cache of ``tokens``."""
        return lambda cls: BackendOptions(kv_tokens=tokens, device=GPU.name if cls is VulkanBackend else CPU)

    assert choose_backend("auto", info, asking(256)) is VulkanBackend
    too_many = int(2 * GPU.free_bytes / VulkanBackend.kv_bytes_per_token(info, "f16"))  # twice its free memory
    if too_many > info.hparams.n_ctx_train:
        pytest.skip(f"{GPU.name} has {GPU.free_bytes / MIB:,.0f} MiB free: more than this model's context needs")
    with caplog.at_level(logging.INFO, logger="edgeinfer.backends"):
        assert choose_backend("auto", info, asking(too_many)).name == "llamacpp"
    assert f"which has {GPU.free_bytes / MIB:,.0f} MiB free" in caplog.text, caplog.text


def test_info_lists_the_builds_devices_with_the_backend_serving_each():
    result = CliRunner().invoke(cli, ["info", "--json"])
    assert result.exit_code == 0, result.output
    devices = {d["name"]: d for d in json.loads(result.output)["llama_cpp_devices"]}
    gpu = devices[GPU.name]
    assert gpu["type"] in ("gpu", "igpu") and (gpu["registry"], gpu["backend"]) == ("Vulkan", "vulkan")
    assert 0 < gpu["free_bytes"] <= gpu["total_bytes"]
    assert devices[CPU]["backend"] == "llamacpp" and devices[CPU]["type"] == "cpu"
    text = CliRunner().invoke(cli, ["info"]).output
    assert f"ggml device {GPU.name} ({gpu['type']}, Vulkan)" in text and "--backend vulkan" in text


def test_a_vulkan_device_that_will_not_open_is_one_line_that_offers_the_cpu(tiny):
    env = {**os.environ, "GGML_VK_VISIBLE_DEVICES": "99"}
    child = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "run", "--backend", "vulkan", "--model", str(tiny), "hi"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode != 0
    assert child.stderr.strip().count("\n") == 0, child.stderr
    assert "GGML_VK_VISIBLE_DEVICES=99" in child.stderr and "--backend llamacpp" in child.stderr
    # auto runs the model on the CPU there, and says nothing of the device.
    child = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "run", "--model", str(tiny), "--max-tokens", "2", "hi"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == 0 and not child.stderr.strip(), child.stderr


def test_a_device_out_of_memory_at_load_is_one_line_that_offers_the_cpu(tiny):
    """ggml-vulkan's own limits, lowered (GGML_VK_FORCE_MAX_BUFFER_SIZE): the cache's buffer cannot be allocated, as
    on a GPU whose memory is taken, and llama.cpp fails the load. ggml writes its failure to std::cerr; the
    backend keeps that for the one line it gives."""
    limits = {"GGML_VK_FORCE_MAX_BUFFER_SIZE": "4096", "GGML_VK_FORCE_MAX_ALLOCATION_SIZE": "4096"}
    child = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "run", "--backend", "vulkan", "--model", str(tiny), "hi"],
        env={**os.environ, **limits}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == 1, child.stderr
    assert child.stderr.strip().count("\n") == 0, child.stderr
    assert "failed to allocate" in child.stderr and "--backend llamacpp" in child.stderr


def test_the_kv_budget_means_the_same_cache_on_the_device_as_on_the_cpu(tiny, llama_log):
    sizes = {}
    for backend in ("vulkan", "llamacpp"):
        with llama_log() as lines, Engine(tiny, backend=backend, kv_budget="1MB") as engine:
            sizes[backend] = (engine.capacity, engine.backend.kv_bytes_per_token(engine.info, "f16"))
        where = GPU.name.capitalize() if backend == "vulkan" else "CPU"
        sizes[backend] += (buffer_mib(lines, where, "KV"),)
    assert sizes["vulkan"] == sizes["llamacpp"] and sizes["vulkan"][2] > 0, sizes
