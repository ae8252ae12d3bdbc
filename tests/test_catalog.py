"""Model specs: the offline default, bad specs, and hf: downloads from a local stand-in for the Hub.

huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE when it is imported, so every case
that depends on them runs the catalog in a fresh interpreter with that environment.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from edgeinfer.errors import DownloadError, ModelNotFoundError
from edgeinfer.models.catalog import (
    CATALOG,
    DEFAULT_MODEL,
    list_models,
    pull,
    resolve_model,
)

from hf_server import FakeHub

ROOT = Path(__file__).resolve().parents[1]

REPO = "acme/Tiny-GGUF"
FILE = "quants/Tiny-Q4_K_M.gguf"  # in a sub-folder, which hf: references allow
REF = f"hf:{REPO}/{FILE}"
CONTENT = b"GGUF" + bytes(range(256)) * 1024

# Runs one catalog call and prints its result, or the EdgeInferError it raised, as JSON.
# Any other exception escapes as a traceback, which run_catalog treats as a failure.
_CHILD = """
import json, sys
from edgeinfer.errors import EdgeInferError
from edgeinfer.models import catalog

op, spec = sys.argv[1:]
try:
    if op == "list":
        result = [
            {"name": m.name, "path": m.path and str(m.path), "size": m.size_bytes,
             "in_catalog": m.in_catalog}
            for m in catalog.list_models()
        ]
    elif op == "pull":
        result = str(catalog.pull(spec, progress=False))
    elif op == "resolve":
        result = str(catalog.resolve_model(spec))
    else:
        result = str(catalog.resolve_model(spec, download=False))
    print(json.dumps({"result": result}))
except EdgeInferError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


def run_catalog(op: str, spec: str = "", **env: str) -> dict:
    """Run ``op`` ("pull", "resolve", "cached" or "list") in a fresh interpreter with ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, op, spec],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def assert_one_line(message: str) -> None:
    assert message and "\n" not in message and "Traceback" not in message


@pytest.fixture
def hub():
    with FakeHub({(REPO, FILE): CONTENT}, gated=frozenset({"acme/Gated-GGUF"})) as served:
        yield served


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    """Point this process's huggingface_hub at an empty cache (the catalog reads it per call)."""
    cache = tmp_path / "hub"
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    return cache


# --- the default model, offline ------------------------------------------------------------


def test_default_model_resolves_offline_from_its_package(tmp_path):
    answer = run_catalog("resolve", DEFAULT_MODEL, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))

    path = Path(answer["result"])
    assert path.is_file()
    assert path.stat().st_size == CATALOG[DEFAULT_MODEL].size_bytes == 98_362_432
    with path.open("rb") as model:
        assert model.read(4) == b"GGUF"
    assert not (tmp_path / "hub").exists()  # nothing was downloaded
    assert pull(DEFAULT_MODEL) == path  # pulling it needs no download either


def test_list_models_shows_every_catalog_entry_without_a_cache(empty_hub_cache):
    listings = {m.name: m for m in list_models()}

    assert set(CATALOG) <= set(listings)
    default = listings[DEFAULT_MODEL]
    assert default.in_catalog and default.path is not None
    assert default.size_bytes == default.path.stat().st_size
    for alias, entry in CATALOG.items():
        if entry.package is None and not entry.parts:  # not shipped by a package: only a download brings it
            assert listings[alias].path is None
            assert listings[alias].size_bytes == entry.size_bytes


# --- specs that name no file ---------------------------------------------------------------


def test_existing_path_resolves_to_itself(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(CONTENT)

    assert resolve_model(str(model)) == model
    assert resolve_model(model) == model


@pytest.mark.parametrize("spec", ["missing.gguf", "models/missing", "~/nowhere/model.gguf"])
def test_missing_path_is_model_not_found(spec):
    with pytest.raises(ModelNotFoundError) as raised:
        resolve_model(spec)

    message = str(raised.value)
    assert_one_line(message)
    assert message.startswith("model file not found: ")
    assert "hf:ORG/REPO/FILE.gguf" in message


def test_unknown_alias_lists_the_known_ones():
    with pytest.raises(ModelNotFoundError) as raised:
        resolve_model("no-such-model")

    message = str(raised.value)
    assert_one_line(message)
    assert "no-such-model" in message
    assert all(alias in message for alias in CATALOG)


@pytest.mark.parametrize(
    "spec",
    [
        "hf:",
        "hf:acme",
        "hf:acme/Tiny-GGUF",
        "hf:acme/Tiny-GGUF/",
        "hf:acme/Tiny-GGUF/README.md",
        "hf:acme/Tiny-GGUF/../escape.gguf",
        "hf:acme/Tiny--GGUF/model.gguf",
        "hf:acme/Tiny GGUF/model.gguf",
    ],
)
def test_malformed_hf_reference_names_the_expected_form(spec, empty_hub_cache):
    with pytest.raises(ModelNotFoundError) as raised:
        resolve_model(spec)

    message = str(raised.value)
    assert_one_line(message)
    assert "expected hf:ORG/REPO/FILE.gguf" in message


def test_hf_reference_not_downloaded_says_to_pull(empty_hub_cache):
    with pytest.raises(ModelNotFoundError) as raised:
        resolve_model(REF, download=False)

    assert_one_line(str(raised.value))
    assert f"edgeinfer pull {REF}" in str(raised.value)


# --- hf: downloads against the local Hub ---------------------------------------------------


def test_pull_downloads_into_the_hf_cache_once(hub, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path)}

    path = Path(run_catalog("pull", REF, **env)["result"])

    assert path.is_relative_to(tmp_path / "hub")
    assert path.read_bytes() == CONTENT
    assert any(r.method == "GET" and FILE in r.path for r in hub.requests)

    requests_so_far = len(hub.requests)
    assert run_catalog("resolve", REF, **env) == {"result": str(path)}
    assert run_catalog("cached", REF, **env) == {"result": str(path)}
    assert len(hub.requests) == requests_so_far  # served from the cache, no network

    listings = {m["name"]: m for m in run_catalog("list", **env)["result"]}
    assert listings[REF] == {
        "name": REF,
        "path": str(path),
        "size": len(CONTENT),
        "in_catalog": False,
    }


def test_dropped_download_resumes_with_a_range_request(tmp_path):
    # huggingface_hub writes in 10 MiB chunks and resumes after the last whole one, so the
    # connection has to drop past the first chunk for a resume to show.
    content = b"GGUF" + bytes(range(256)) * (48 * 1024)  # 12 MiB
    cut = 11 * 1024 * 1024
    with FakeHub({(REPO, FILE): content}, drop_first_get_after=cut) as hub:
        answer = run_catalog("pull", REF, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path))

    assert Path(answer["result"]).read_bytes() == content
    first, second = [r.range for r in hub.requests if r.method == "GET" and FILE in r.path]
    assert first is None
    assert second is not None and 0 < int(second.removeprefix("bytes=").rstrip("-")) <= cut


@pytest.mark.parametrize(
    ("ref", "problem"),
    [
        (f"hf:{REPO}/missing.gguf", f"no file missing.gguf in {REPO}"),
        ("hf:acme/Missing-GGUF/model.gguf", "no repository acme/Missing-GGUF"),
        ("hf:acme/Gated-GGUF/model.gguf", "acme/Gated-GGUF is gated"),
    ],
)
def test_missing_or_refused_file_is_download_error(hub, tmp_path, ref, problem):
    answer = run_catalog("pull", ref, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path))

    assert answer["error"] == DownloadError.__name__
    assert_one_line(answer["message"])
    assert answer["message"].startswith(f"cannot download {ref}: {problem}")


def test_unreachable_hub_is_download_error_quickly(tmp_path):
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"

    started = time.monotonic()
    answer = run_catalog("pull", REF, HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path))

    assert answer["error"] == DownloadError.__name__
    assert_one_line(answer["message"])
    assert f"no network connection to {endpoint}" in answer["message"]
    assert time.monotonic() - started < 10  # not half a minute of retries first


def test_offline_mode_blocks_downloads_with_a_clear_error(hub, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}

    pulled = run_catalog("pull", REF, **env)
    cached_only = run_catalog("cached", REF, **env)

    assert pulled["error"] == DownloadError.__name__
    assert_one_line(pulled["message"])
    assert "offline mode" in pulled["message"] and "HF_HUB_OFFLINE" in pulled["message"]
    assert cached_only["error"] == ModelNotFoundError.__name__
    assert "edgeinfer pull" in cached_only["message"]
    assert hub.requests == []


def test_pull_of_a_local_path_only_checks_it(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(CONTENT)

    assert pull(str(model)) == model
    with pytest.raises(ModelNotFoundError):
        pull(str(tmp_path / "gone.gguf"))


@pytest.mark.parametrize("spec", [None, 0, b"model.gguf", "a\x00b.gguf", "x" * 300, "x" * 300 + ".gguf"])
def test_a_model_that_is_no_path_or_too_long_a_name_is_one_line(spec):
    """Not a traceback (TypeError, ValueError for the NUL, OSError for a name past the file system's limit)."""
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model(spec)  # type: ignore[arg-type]
    assert "\n" not in str(exc.value)
