"""Refusing early: the native-build probe, the memory check, and thread counts; and the facts about
this process that several parts share (peak RSS, llama.cpp's libraries, a child's environment, atomic writes)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import edgeinfer
from edgeinfer import BackendUnavailableError, Engine, InsufficientMemoryError, InvalidOptionError, system
from edgeinfer.backends import backend_class
from edgeinfer.backends.base import BackendOptions
from edgeinfer.buildflags import contrast_cmake_args, cpu_flags, rebuild_command, safe_cmake_args
from edgeinfer.files import atomic_path, write_atomic
from edgeinfer.models.info import load_model_info
from edgeinfer.system import (
    INTERESTING_CPU_FLAGS,
    MemoryNeed,
    available_ram,
    cache_dir,
    check_memory,
    child_env,
    cpu_features,
    free_cores,
    llama_cpp_libraries,
    peak_rss,
    probe_native_build,
    thread_count,
    usable_cores,
)

MIB = 2**20


def test_probe_passes_on_this_build_and_is_remembered(model_path):
    state = cache_dir() / "native-probe.json"
    state.unlink(missing_ok=True)
    probe_native_build(model_path)
    verdicts = json.loads(state.read_text())
    assert list(verdicts.values()) == ["ok"]
    probe_native_build(model_path)  # second time: read from the cache, no child
    assert json.loads(state.read_text()) == verdicts


def test_a_child_killed_by_sigill_becomes_the_rebuild_advice(model_path):
    # A real process dying of SIGILL, as an AMX-faulting llama.cpp does at its first decode.
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]
    with pytest.raises(BackendUnavailableError) as info:
        probe_native_build(model_path, command=crash)
    message = str(info.value)
    assert "illegal instruction" in message and "\n" not in message
    assert "-DGGML_AMX_TILE=OFF" in message and "pip install --no-cache-dir" in message


def test_other_native_crashes_are_named(model_path):
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    with pytest.raises(BackendUnavailableError, match="SIGSEGV"):
        probe_native_build(model_path, command=crash)


def test_build_flags_turn_amx_off_only_where_the_cpu_reports_it():
    amx_cpu = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"}
    args = safe_cmake_args(amx_cpu)
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AMX_INT8=OFF" in args
    assert "-DGGML_AVX512=ON" in args and "-DGGML_AVX512_BF16=OFF" in args
    assert safe_cmake_args({"avx", "avx2"}) == ""  # no AMX: the native build is right
    assert "--no-cache-dir" in rebuild_command(amx_cpu)


def test_contrast_build_is_one_instruction_set_tier_below_the_cpu():
    base = {"avx", "avx2", "fma", "f16c", "bmi2"}
    avx512 = contrast_cmake_args(base | {"avx512f", "avx512vbmi", "avx512_vnni", "amx_tile"})
    assert "-DGGML_NATIVE=OFF" in avx512 and "-DGGML_AVX2=ON" in avx512 and "-DGGML_FMA=ON" in avx512
    assert "-DGGML_AVX512=OFF" in avx512 and "-DGGML_AVX512_VNNI=OFF" in avx512 and "-DGGML_AMX_INT8=OFF" in avx512
    avx2 = contrast_cmake_args(base)
    assert "-DGGML_AVX=ON" in avx2 and "-DGGML_AVX2=OFF" in avx2 and "-DGGML_FMA=OFF" in avx2
    assert "=ON" not in contrast_cmake_args({"sse4_2"})
    # What this machine's CI builds: never an instruction set the CPU lacks.
    here = cpu_flags()
    for flag, option in (("avx512f", "GGML_AVX512"), ("avx2", "GGML_AVX2"), ("avx", "GGML_AVX")):
        if f"-D{option}=ON" in contrast_cmake_args():
            assert flag in here


def test_memory_check_refuses_what_fits_neither_ram_nor_the_device(model_path):
    need = backend_class("llamacpp").memory(load_model_info(model_path), BackendOptions(kv_tokens=512))
    assert need.weights == model_path.stat().st_size and need.kv == 512 * 23040  # the file, mapped; f16 KV
    check_memory(need, force=False)  # 200 MB fits here
    huge = dataclasses.replace(need, weights=available_ram() * 2)
    with pytest.raises(InsufficientMemoryError) as exc:
        check_memory(huge, force=False)
    assert "--force" in str(exc.value) and "--kv-budget" in str(exc.value) and "\n" not in str(exc.value)
    check_memory(huge, force=True)
    # Layers on a GPU count against its memory, not the host's.
    offloaded = MemoryNeed(
        weights=0, kv=0, overhead=96 * MIB, device="gpu0", device_bytes=2048 * MIB, device_free=1024 * MIB
    )
    with pytest.raises(InsufficientMemoryError) as exc:
        check_memory(offloaded, force=False)
    assert "gpu0" in str(exc.value) and "--gpu-layers" in str(exc.value) and "\n" not in str(exc.value)
    check_memory(dataclasses.replace(offloaded, device_free=4096 * MIB), force=False)
    check_memory(offloaded, force=True)


def test_one_rule_counts_threads():
    assert 1 <= thread_count() <= usable_cores()
    assert thread_count(10_000) == usable_cores() and thread_count(1) == 1  # asked for: capped at the cores
    assert thread_count(spinning=False) == usable_cores()  # threads that sleep may have every core
    assert thread_count(spare=10_000) == 1
    with pytest.raises(InvalidOptionError, match="threads must be at least 1, got 0"):
        thread_count(0)


def test_free_cores_counts_other_processes_load_and_not_this_ones():
    if usable_cores() < 2:
        pytest.skip("needs two cores: one to keep busy, one to stay free")
    time.sleep(system.MIN_WINDOW_S)
    free_cores()  # the window starts here
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # this process's own work (an import, a model's load) leaves cores free
        pass
    idle = free_cores()
    assert idle >= 2, "another process kept a core busy: the test needs a quiet machine"
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # the window since the last call holds the spinner's half second
        assert free_cores() == idle - 1
        time.sleep(system.MAX_WINDOW_S + 0.1)  # too old a window: a fresh sample, still with the spinner
        assert free_cores() == idle - 1
    finally:
        spinner.kill()
        spinner.wait()


def test_a_child_imports_this_edgeinfer_and_reports_its_own_peak_rss(tmp_path):
    code = (
        "import edgeinfer, numpy; from edgeinfer.system import peak_rss; "
        "a = numpy.ones(2**24); print(edgeinfer.__file__, peak_rss())"
    )
    # Elsewhere than the checkout, so only PYTHONPATH can lead the child to it.
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.split()
    assert Path(out[0]) == Path(edgeinfer.__file__)
    assert 128 * MIB <= int(out[1]) < 512 * MIB  # the 128 MiB it touched, and none of the parent's peak
    assert peak_rss() >= psutil.Process().memory_info().rss


def test_llama_cpp_libraries_are_found_once_for_every_user():
    from edgeinfer.converters.quantize import _ggml

    libraries = llama_cpp_libraries()
    assert libraries and any(lib.name.startswith("libggml-base") for lib in libraries)
    assert _ggml() is not None  # the quantizer loads ggml from that list


def test_an_atomic_write_gives_the_whole_new_file_or_leaves_the_old(tmp_path):
    target = tmp_path / "state.json"
    write_atomic(target, "old")
    write_atomic(target, "new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["state.json"]
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half of a new")
        raise RuntimeError("the writer failed")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["state.json"]


def test_machine_facts():
    features = cpu_features()
    assert features == [f for f in INTERESTING_CPU_FLAGS if f in set(features)]  # fixed order, no duplicates
    assert set(features) <= cpu_flags()
    assert available_ram() > 0


def test_engine_passes_its_threads_to_llama_cpp(model_path):
    import llama_cpp

    with Engine(model_path, kv_budget="512tok", threads=1) as engine:
        assert engine.threads == 1
        assert llama_cpp.llama_n_threads(engine.backend._ctx) == 1


def test_engine_runs_the_probe_before_loading(model_path):
    state = cache_dir() / "native-probe.json"
    state.unlink(missing_ok=True)
    with Engine(model_path, kv_budget="512tok", threads=1):
        assert list(json.loads(state.read_text()).values()) == ["ok"]


def test_a_damaged_probe_cache_is_ignored(model_path):
    state = cache_dir() / "native-probe.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text("[]")
    probe_native_build(model_path)
    assert list(json.loads(state.read_text()).values()) == ["ok"]


def test_a_cache_dir_from_the_environment_may_start_at_home(tmp_path, monkeypatch):
    """As an environment file or a service's settings write it, unexpanded: not a folder named "~" in the cwd."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", "~/edgeinfer-cache")
    assert cache_dir() == tmp_path / "edgeinfer-cache"
    monkeypatch.delenv("EDGEINFER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "~/.xdg")
    assert cache_dir() == tmp_path / ".xdg" / "edgeinfer"
