"""Every registered backend through the same checks: the contract in backends/base.py, kept.

The tests run once per name in ``edgeinfer.backends.BACKENDS``, so a new backend is checked by
registering itself there. A backend is skipped only where ``backend_class`` raises
``BackendUnavailableError`` (it cannot run here), with that reason. The ground truth is the
reference backend with an f32 KV cache; it runs the suite too, and agrees with itself.

Models: the tiny GGUFs of tiny_model.py with sharpened norms (conformance_models.py: on the plain
ones a backend that forgot to re-rotate keys would still pass), so the suite is quick, and
SmolLM2 for agreement on real weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from conformance_models import kld, poison_token, top1, write_sharp_gguf
from gguf import GGUFValue, GGUFValueType

from edgeinfer import BackendError, BackendUnavailableError, EdgeInferError, Engine
from edgeinfer.backends import BACKENDS, backend_class
from edgeinfer.backends.base import ARGMAX_NOT_FINITE, CPU, Backend, BackendOptions, Span
from edgeinfer.models.info import ModelInfo, load_model_info
from edgeinfer.streams import drain
from edgeinfer.tokenizer import Tokenizer

TEXT = (Path(__file__).parent / "data" / "lighthouse.txt").read_text()
TOKENS = [int(t) for t in np.random.default_rng(1).integers(3, 250, size=96)]  # in every tiny vocabulary
OTHER = [int(t) for t in np.random.default_rng(2).integers(3, 250, size=96)]

TINY = {
    "llama": {"arch": "llama", "n_ctx": 8192},  # F32, byte-level BPE, "norm" RoPE, tied output
    "qwen2": {"arch": "qwen2", "n_head": 4, "n_embd": 256, "n_head_kv": 2},  # Q/K/V biases, neox RoPE, GQA
    "mistral-q4_0": {"arch": "mistral", "tensor_type": "Q4_0", "tokenizer": "llama", "tied": False},
    # One layer: its keys depend only on token and position, so evicting and re-rotating them is
    # exactly a cold run of the kept tokens at their new positions.
    "llama-1": {"arch": "llama", "n_layer": 1},
    "qwen2-1": {"arch": "qwen2", "n_head": 4, "n_embd": 256, "n_head_kv": 2, "n_layer": 1},
    "scaled": {"metadata": {"llama.rope.scaling.type": GGUFValue("linear", GGUFValueType.STRING)}},
    "nan": {"poison": float("nan")},
    "inf": {"poison": float("inf")},
}

# Agreement with the reference backend (f32 cache): (largest mean KLD in nats, smallest top-1 share),
# by model and KV type, over 48 prompt tokens and 16 decoded one at a time (SmolLM2: 30 and 10).
# Measured with llama.cpp (llama-cpp-python 0.3.36, AVX2, 2 threads), KLD / top-1, before its f16 cache was
# read by flash attention (the suite's bounds hold with it too):
#                 f32             f16             q8_0
#   llama         7.7e-13 / 1.0   2.4e-7 / 1.0    1.1e-4 / 1.0
#   qwen2         4.9e-12 / 1.0   1.2e-6 / 1.0    6.8e-4 / 0.969
#   mistral Q4_0  2.7e-4 / 1.0    2.7e-4 / 1.0    3.8e-4 / 0.984   (llama.cpp's 8-bit activations)
#   SmolLM2 Q4_1  3.6e-3 / 1.0    3.5e-3 / 1.0    4.5e-3 / 1.0     (nearest runner-up 0.09 logits behind)
# and the reference itself: f32 below 1e-11, f16 1e-7 to 8e-7, top-1 1.0. A lost RoPE or a cache mixed
# up between positions costs KLD 0.1 to 2 on these models.
AGREEMENT: dict[str, dict[str, tuple[float, float]]] = {
    "llama": {"f32": (1e-6, 0.95), "f16": (1e-5, 0.95), "q8_0": (2e-3, 0.9)},
    "qwen2": {"f32": (1e-6, 0.95), "f16": (2e-5, 0.95), "q8_0": (3e-3, 0.9)},
    "mistral-q4_0": {"f32": (3e-3, 0.9), "f16": (3e-3, 0.9), "q8_0": (3e-3, 0.9)},
    "smollm2": {"f32": (0.02, 0.9), "f16": (0.02, 0.9), "q8_0": (0.025, 0.9)},
}
# Backends whose products round to half precision whatever the cache: llama.cpp's Vulkan shaders convert
# activations to f16 on a device that has it, and a newer driver or glslc takes other shaders (cooperative
# matrices, integer dot products). They are held to HALF_PRECISION_SLACK times the f16 bound, whatever the cache:
# 5e-5 to 1e-4 on the plain models, three orders below what a lost RoPE costs. Measured on Debian 12's lavapipe,
# f32 cache: llama 7.5e-7, qwen2 3.2e-6 (f16 cache 5.8e-6), mistral Q4_0 2.7e-4 (bound 1.5e-2).
HALF_PRECISION_PRODUCTS = ("vulkan",)
FLASH_ATTENTION_F16 = ("llamacpp",)  # its f16 cache is read by flash attention, which sums values in f16
HALF_PRECISION_SLACK = 5
# Evicting positions 4..23 of 60 on a one-layer model, then 10 more tokens, against a cold run of
# the 40 kept ones. Measured: f32 1e-13, f16 5e-7 (before flash attention), q8_0 2.5e-4 (llama.cpp);
# keys left unrotated: 0.15 (llama) and 2.2 (qwen2).
EVICT_KLD = {"f32": 1e-6, "f16": 1e-4, "q8_0": 5e-3}
# Logits of one sequence evaluated beside another, or continued from a shared prefix, against the
# same tokens alone: only the batch's shape differs. Measured: llama.cpp 0 (bit-equal) beside another
# sequence and 5e-14 from a copied prefix (before flash attention); the reference 1.3e-9 (its f16 cache
# rounds the other batch's keys differently) and 0.
SEQUENCE_KLD = 1e-5


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(BACKENDS))
def cls(request: pytest.FixtureRequest) -> type[Backend]:
    """Each registered backend's class, or a skip saying why it cannot run here."""
    try:
        return backend_class(request.param)
    except BackendUnavailableError as exc:
        pytest.skip(f"the {request.param} backend cannot run here: {exc}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("conformance")
    return {name: write_sharp_gguf(folder / f"{name}.gguf", **options) for name, options in TINY.items()}


@pytest.fixture(scope="module")
def infos(tiny: dict[str, Path], model_path: Path) -> dict[str, ModelInfo]:
    return {**{name: load_model_info(path) for name, path in tiny.items()}, "smollm2": load_model_info(model_path)}


@pytest.fixture(scope="module")
def prompts(model_path: Path) -> dict[str, list[int]]:
    """The tokens each agreement check evaluates, by model."""
    tokenizer = Tokenizer(model_path)
    try:
        smollm2 = tokenizer.encode(TEXT)[:40]
    finally:
        tokenizer.close()
    return {**dict.fromkeys(TINY, TOKENS[:64]), "smollm2": smollm2}


@pytest.fixture(scope="module")
def truth(infos: dict[str, ModelInfo], prompts: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """The reference backend's logits for every prompt token, f32 cache, one evaluation, by model (computed once)."""
    computed: dict[str, np.ndarray] = {}
    for model in AGREEMENT:
        tokens = prompts[model]
        with opened(backend_class("reference"), infos[model], kv_type="f32", batch_size=len(tokens)) as ref:
            computed[model] = logits(ref, Span(0, 0, tokens, all_logits=True))[0]
    return computed


# -- helpers --------------------------------------------------------------------------------------


@contextmanager
def opened(cls: type[Backend], info: ModelInfo, **options: object) -> Iterator[Backend]:
    """A backend made straight from its class, closed afterwards."""
    kv_type = "f16" if "f16" in cls.kv_types else cls.kv_types[0]  # the engine's default where it has it
    settings: dict[str, object] = {"kv_tokens": 256, "kv_type": kv_type, "threads": 2, "batch_size": 64}
    backend = cls(info, BackendOptions(**{**settings, **options}))
    try:
        yield backend
    finally:
        backend.close()


def logits(backend: Backend, *spans: Span) -> list[np.ndarray]:
    """One eval call; copies of its arrays (the backend may reuse its buffer)."""
    out = backend.eval(list(spans))
    assert len(out) == len(spans)
    for span, row in zip(spans, out, strict=True):
        shape = (len(span.tokens), backend.n_vocab) if span.all_logits else (backend.n_vocab,)
        assert row.shape == shape and row.dtype == np.float32, (row.shape, row.dtype, shape)
    return [np.array(row, copy=True) for row in out]


def chunked(backend: Backend, seq: int, tokens: Sequence[int], start: int = 0, size: int = 64) -> np.ndarray:
    """Evaluate ``tokens`` for ``seq`` in calls of at most ``size`` tokens; the last token's logits."""
    row = None
    for first in range(0, len(tokens), size):
        (row,) = logits(backend, Span(seq, start + first, tokens[first : first + size]))
    assert row is not None
    return row


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert message.strip() and "\n" not in message, f"not a one-line message: {message!r}"
    return message


def assert_close(expected: np.ndarray, actual: np.ndarray, bound: float, what: str) -> None:
    divergence, agree = kld(expected, actual), top1(expected, actual)
    assert divergence < bound and agree == 1.0, f"{what}: KLD {divergence:.2e} (bound {bound:.0e}), top-1 {agree:.3f}"


# -- what a backend says about itself -------------------------------------------------------------


def test_registered_under_its_own_name_and_implements_the_protocol(cls, infos):
    assert cls.name in BACKENDS and backend_class(cls.name) is cls, f"{cls.__name__} is registered as {cls.name!r}?"
    assert cls.kv_block >= 1 and cls.kv_types
    devices = cls.devices()
    assert devices and devices[0].name == CPU, f"the CPU first: {devices}"
    with opened(cls, infos["llama"]) as backend:
        assert isinstance(backend, Backend)
        assert backend.n_vocab == infos["llama"].hparams.n_vocab
        assert backend.n_seq == 1
        assert backend.can_shift, "a RoPE transformer's cache can shift; only caches without positions cannot"
        assert backend.can_truncate, "a transformer's cache truncates anywhere; only a recurrent state cannot"


def test_kv_bytes_and_memory_follow_the_cache_it_lays_out(cls, infos):
    info = infos["llama"]
    floor = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}  # bytes per value at least, by what the type stores
    sizes = {kv: cls.kv_bytes_per_token(info, kv) for kv in cls.kv_types}
    for kv, size in sizes.items():
        assert size >= info.kv_values_per_token * floor.get(kv, 0.0) and size > 0, (kv, size)
    small = cls.memory(info, BackendOptions(kv_tokens=256, kv_type=cls.kv_types[0]))
    large = cls.memory(info, BackendOptions(kv_tokens=1024, kv_type=cls.kv_types[0]))
    assert small.overhead > 0
    if cls.devices()[0].has_own_memory:  # by default on a GPU (vulkan): weights and cache are its memory
        assert small.device != CPU and small.device_free is not None
        assert small.device_bytes >= info.file_size + 256 * sizes[cls.kv_types[0]]
        assert large.device_bytes - small.device_bytes >= 768 * sizes[cls.kv_types[0]] - 1
        return
    assert small.device == CPU and small.device_bytes == 0 and small.weights > 0
    assert small.kv >= 256 * sizes[cls.kv_types[0]], "the KV cache a CPU backend allocates is host memory"
    assert large.kv - small.kv >= 768 * sizes[cls.kv_types[0]] - 1 and large.total > small.total


def test_supports_answers_none_or_one_line_and_the_engine_honours_it(cls, infos, tiny):
    assert cls.supports(infos["llama"]) is None, "every backend runs the plainest model: an F32 llama"
    for model, info in infos.items():
        reason = cls.supports(info)
        assert reason is None or (isinstance(reason, str) and reason.strip() and "\n" not in reason), (model, reason)
    reason = cls.supports(infos["scaled"])  # RoPE scaling: llama.cpp does it, the reference backend does not
    if reason is None:
        with opened(cls, infos["scaled"]) as backend:
            (row,) = logits(backend, Span(0, 0, TOKENS[:8]))
            assert np.isfinite(row).all()
        return
    with pytest.raises(EdgeInferError) as exc:
        Engine(tiny["scaled"], backend=cls.name, kv_budget="256tok", threads=2)
    assert reason in one_line(exc)


def test_the_reference_backend_refuses_rope_scaling(infos):
    reason = backend_class("reference").supports(infos["scaled"])
    assert reason is not None and "RoPE" in reason


# -- agreement with the reference backend ---------------------------------------------------------


@pytest.mark.parametrize("model", list(AGREEMENT))
def test_agrees_with_the_reference_backend_for_every_kv_type(cls, infos, prompts, truth, model):
    reason = cls.supports(infos[model])
    if reason is not None:  # a backend may decline a model, in so many words (none declines these today)
        pytest.skip(f"the {cls.name} backend does not run {model}: {reason}")
    tokens = prompts[model]
    n_prompt = len(tokens) * 3 // 4  # the rest are decoded one at a time, through the cache
    expected = truth[model]
    failures, measured = [], []
    for kv_type in cls.kv_types:
        if kv_type not in AGREEMENT[model]:
            failures.append(f"no agreement bound for KV type {kv_type!r}: measure one and add it to AGREEMENT")
            continue
        with opened(cls, infos[model], kv_type=kv_type) as backend:
            rows = logits(backend, Span(0, 0, tokens[:n_prompt], all_logits=True))
            rows += [logits(backend, Span(0, i, [tokens[i]]))[0][None] for i in range(n_prompt, len(tokens))]
        ours = np.concatenate(rows)
        assert np.isfinite(ours).all(), f"{kv_type}: non-finite logits"
        divergence, agree = kld(expected, ours), top1(expected, ours)
        measured.append(f"{kv_type}: KLD {divergence:.2e}, top-1 {agree:.3f}")
        bound, least = AGREEMENT[model][kv_type]
        if cls.name in HALF_PRECISION_PRODUCTS:
            bound = max(bound, HALF_PRECISION_SLACK * AGREEMENT[model]["f16"][0])
        if divergence >= bound or agree < least:
            failures.append(f"{kv_type} beyond KLD {bound:.0e} / top-1 {least}")
    assert not failures, f"{cls.name} on {model}: {'; '.join(failures)} (measured {'; '.join(measured)})"


# -- truncate and evict ---------------------------------------------------------------------------


def test_truncate_then_the_same_tokens_give_the_same_logits(cls, infos):
    with opened(cls, infos["llama"]) as backend:
        logits(backend, Span(0, 0, TOKENS[:20]))
        (first,) = logits(backend, Span(0, 20, TOKENS[20:40], all_logits=True))
        backend.truncate(0, 20)
        with pytest.raises(BackendError) as exc:  # the sequence holds 20 positions now, not 40
            backend.eval([Span(0, 40, TOKENS[40:41])])
        one_line(exc)
        (again,) = logits(backend, Span(0, 20, TOKENS[20:40], all_logits=True))
        # The same cache contents, the same batch, the same threads: the same arithmetic. The engine's
        # promise of the same greedy answer cold and after a chat turn rests on this.
        assert np.array_equal(first, again), f"max difference {np.abs(first - again).max():.2e}"
        backend.truncate(0, 25)  # into the middle of what one call evaluated: another split, so close only
        (tail,) = logits(backend, Span(0, 25, TOKENS[25:40], all_logits=True))
        assert_close(first[5:], tail, 1e-6, "after truncating mid-batch")
        backend.truncate(0, 1000)  # past the end: nothing to forget, so position 40 comes next
        logits(backend, Span(0, 40, TOKENS[40:41]))
        # What was truncated is forgotten: another continuation equals a cold run with it.
        backend.truncate(0, 20)
        (other,) = logits(backend, Span(0, 20, OTHER[:20], all_logits=True))
    with opened(cls, infos["llama"]) as cold:
        logits(cold, Span(0, 0, TOKENS[:20]))
        (fresh,) = logits(cold, Span(0, 20, OTHER[:20], all_logits=True))
    assert_close(fresh, other, 1e-6, "a continuation after truncate against a cold run")


@pytest.mark.parametrize("model", ["llama-1", "qwen2-1"])
def test_evict_re_rotates_the_keys_it_shifts(cls, infos, model):
    kept = TOKENS[:4] + TOKENS[24:60]
    for kv_type in cls.kv_types:
        with opened(cls, infos[model], kv_type=kv_type) as backend:
            logits(backend, Span(0, 0, TOKENS[:60]))
            backend.evict(0, 4, 24)  # positions 24..59 move down to 4..39
            (shifted,) = logits(backend, Span(0, 40, TOKENS[60:70], all_logits=True))
            backend.truncate(0, 0)
            logits(backend, Span(0, 0, kept))
            (cold,) = logits(backend, Span(0, 40, TOKENS[60:70], all_logits=True))
        assert_close(cold, shifted, EVICT_KLD.get(kv_type, 5e-3), f"{model}, {kv_type} cache: evicted vs cold")


def test_evict_moves_only_its_own_sequence(cls, infos):
    kept = TOKENS[:4] + TOKENS[24:60]
    after = (Span(0, 20, OTHER[20:30], all_logits=True), Span(1, 40, TOKENS[60:70], all_logits=True))
    with opened(cls, infos["llama-1"], n_seq=2) as backend:
        logits(backend, Span(0, 0, OTHER[:20]))
        logits(backend, Span(1, 0, TOKENS[:60]))
        backend.evict(1, 4, 24)
        shifted_0, shifted_1 = logits(backend, *after)
    with opened(cls, infos["llama-1"], n_seq=2) as cold:
        logits(cold, Span(0, 0, OTHER[:20]))
        logits(cold, Span(1, 0, kept))
        cold_0, cold_1 = logits(cold, *after)
    assert_close(cold_0, shifted_0, SEQUENCE_KLD, "sequence 0 after an eviction in sequence 1")
    assert_close(cold_1, shifted_1, EVICT_KLD["f16"], "sequence 1 after its eviction")


def test_evict_on_several_layers_agrees_with_the_reference(cls, infos):
    # With two layers the shifted keys carry context from the evicted tokens, so compare to the
    # reference backend doing the same eviction. Measured: f32 5e-13, f16 1.4e-7, q8_0 1e-4.
    def run(backend: Backend) -> np.ndarray:
        logits(backend, Span(0, 0, TOKENS[:60]))
        backend.evict(0, 4, 24)
        return logits(backend, Span(0, 40, TOKENS[60:70], all_logits=True))[0]

    with opened(backend_class("reference"), infos["llama"], kv_type="f32") as ref:
        expected = run(ref)
    for kv_type in cls.kv_types:
        with opened(cls, infos["llama"], kv_type=kv_type) as backend:
            ours = run(backend)
        assert_close(expected, ours, {"f32": 1e-6, "f16": 1e-5}.get(kv_type, 2e-3), f"{kv_type} cache")


# -- capacity -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_tokens", [100, 256, 300])
def test_capacity_rounds_up_to_whole_blocks(cls, infos, kv_tokens):
    with opened(cls, infos["llama"], kv_tokens=kv_tokens) as backend:
        assert backend.capacity >= kv_tokens and backend.capacity % cls.kv_block == 0, backend.capacity


def test_filling_to_capacity_works_and_one_more_is_a_clear_error(cls, infos):
    with opened(cls, infos["llama"], kv_tokens=100) as backend:
        capacity = backend.capacity
        tokens = (TOKENS * (capacity // len(TOKENS) + 1))[:capacity]
        last = chunked(backend, 0, tokens)
        assert np.isfinite(last).all()
        with pytest.raises(BackendError) as exc:
            backend.eval([Span(0, capacity, [TOKENS[0]])])
        one_line(exc)
        # Still usable: forget the last position and evaluate it again.
        backend.truncate(0, capacity - 1)
        (again,) = logits(backend, Span(0, capacity - 1, tokens[-1:]))  # alone, where it was in a chunk
        # Half-precision sums, in Vulkan's shaders and in llama.cpp's flash attention over an f16 cache: a vector's
        # kernels round otherwise than a chunk's (lavapipe: 5.6e-6; llama.cpp's CPU kernels: 4.6e-6).
        bound = EVICT_KLD["f16"] if cls.name in HALF_PRECISION_PRODUCTS + FLASH_ATTENTION_F16 else 1e-6
        assert_close(last[None], again[None], bound, "the last position again")


def test_the_cells_are_one_pool_shared_by_the_sequences(cls, infos):
    with opened(cls, infos["llama"], kv_tokens=100, n_seq=2) as backend:
        capacity = backend.capacity
        tokens = (TOKENS * (capacity // len(TOKENS) + 1))[:capacity]
        chunked(backend, 0, tokens[:-8])
        chunked(backend, 1, tokens[:8])  # sequence 1 takes the last 8 cells of the pool
        with pytest.raises(BackendError) as exc:
            backend.eval([Span(1, 8, [TOKENS[0]])])
        one_line(exc)
        backend.truncate(0, capacity - 9)  # a cell freed by sequence 0 serves sequence 1
        (row,) = logits(backend, Span(1, 8, [TOKENS[0]]))
        assert np.isfinite(row).all()
        # copy_prefix empties sequence 1 (9 cells back in the pool) and shares sequence 0's first 4 (no cost),
        # or copies them (4 cells).
        backend.copy_prefix(0, 1, 4)
        room = 9 if cls.shares_cells else 5
        logits(backend, Span(1, 4, OTHER[:room]))
        with pytest.raises(BackendError) as exc:
            backend.eval([Span(1, 4 + room, [OTHER[room]])])
        one_line(exc)


CHILD = """
import sys
from edgeinfer.backends import backend_class
from edgeinfer.backends.base import BackendOptions, Span
from edgeinfer.errors import EdgeInferError
from edgeinfer.models.info import load_model_info
name, path = sys.argv[1:]
try:
    backend = backend_class(name)(load_model_info(path), BackendOptions(kv_tokens=64, threads=2, batch_size=2, n_seq=4))
    rows = backend.eval([Span(seq, 0, [5 + seq, 6, 7]) for seq in range(4)])
    print("evaluated", len(rows), all(row.shape == (backend.n_vocab,) for row in rows))
    backend.close()
except EdgeInferError as exc:
    print("refused:", exc)
"""


def test_more_sequences_than_a_batch_holds_work_without_a_crash(cls, tiny):
    # llama.cpp asserts (and aborts the process) when a context has more sequences than its batch
    # has outputs, so the backend must widen its batch: a child process runs it, in case it does not.
    root = Path(__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", CHILD, cls.name, str(tiny["llama"])]
    child = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    lines = child.stderr.splitlines()
    why = next((line for line in lines if "ASSERT" in line or "Error" in line), lines[-1] if lines else "")
    status = child.returncode
    assert status == 0, f"exit status {status}: {why}"
    assert child.stdout.startswith("evaluated 4 True"), child.stdout


# -- several sequences ----------------------------------------------------------------------------


def test_sequences_in_one_call_equal_each_alone(cls, infos):
    a, b = TOKENS[:20], OTHER[:13]  # different lengths, so rows mixed up between them show
    with opened(cls, infos["llama"], n_seq=2) as backend:
        alone: list[np.ndarray] = []
        for seq, tokens, more, last in ((0, a, TOKENS[20:25], TOKENS[25]), (1, b, OTHER[13:14], OTHER[14])):
            alone += logits(backend, Span(seq, 0, tokens, all_logits=True))
            alone += logits(backend, Span(seq, len(tokens), more, all_logits=seq == 0))
            alone += logits(backend, Span(seq, len(tokens) + len(more), [last]))
            backend.truncate(seq, 0)
        together = logits(backend, Span(0, 0, a, all_logits=True), Span(1, 0, b, all_logits=True))
        # Both continue from different lengths, one with every row and one without, listed the other way round.
        together += logits(backend, Span(1, 13, OTHER[13:14]), Span(0, 20, TOKENS[20:25], all_logits=True))[::-1]
        together += logits(backend, Span(0, 25, [TOKENS[25]]), Span(1, 14, [OTHER[14]]))  # rows of one shape
    order = [0, 2, 4, 1, 3, 5]  # together's arrays, in alone's order
    for i, (expected, actual) in enumerate(zip(alone, [together[k] for k in order], strict=True)):
        seq, step = divmod(i, 3)
        assert_close(np.atleast_2d(expected), np.atleast_2d(actual), SEQUENCE_KLD, f"sequence {seq}, call {step}")


def test_an_evaluation_that_fails_changes_nothing(cls, infos):
    with opened(cls, infos["llama"], kv_tokens=100, batch_size=16) as backend:
        capacity = backend.capacity
        logits(backend, Span(0, 0, TOKENS[:10]))
        too_long = (OTHER * (capacity // len(OTHER) + 1))[:capacity]  # chunks fit until the cache is full
        with pytest.raises(BackendError) as exc:
            backend.eval([Span(0, 10, too_long)])
        one_line(exc)
        (after,) = logits(backend, Span(0, 10, TOKENS[10:12]))  # as if the failed call never happened
    with opened(cls, infos["llama"], kv_tokens=100, batch_size=16) as cold:
        logits(cold, Span(0, 0, TOKENS[:10]))
        (expected,) = logits(cold, Span(0, 10, TOKENS[10:12]))
    assert_close(expected[None], after[None], 1e-6, "after a failed evaluation")


def test_a_token_outside_the_vocabulary_is_a_clear_error_that_changes_nothing(cls, infos):
    with opened(cls, infos["llama"]) as backend:
        logits(backend, Span(0, 0, TOKENS[:4]))
        for bad in (backend.n_vocab, -1):
            with pytest.raises(BackendError) as exc:
                backend.eval([Span(0, 4, [TOKENS[4], bad])])
            assert "vocabulary" in one_line(exc)
        (row,) = logits(backend, Span(0, 4, [TOKENS[4]]))  # the sequence still holds its 4 positions
        assert np.isfinite(row).all()


def test_a_sequence_cannot_be_copied_into_itself(cls, infos):
    with opened(cls, infos["llama"]) as backend:
        logits(backend, Span(0, 0, TOKENS[:8]))
        with pytest.raises(BackendError, match="into itself"):
            backend.copy_prefix(0, 0, 4)


def test_a_copied_prefix_continues_as_if_computed_and_truncating_the_copy_leaves_the_source(cls, infos):
    prefix, rest_0, rest_1 = TOKENS[:16], TOKENS[16:24], OTHER[:12]
    with opened(cls, infos["llama"], n_seq=2) as backend:
        chunked(backend, 1, OTHER[40:70])  # something for copy_prefix to empty first
        logits(backend, Span(0, 0, prefix))
        logits(backend, Span(0, 16, rest_0))
        backend.copy_prefix(0, 1, 16)
        (shared,) = logits(backend, Span(1, 16, rest_1, all_logits=True))
        backend.truncate(1, 8)  # inside the shared cells: sequence 0 must keep them
        (after_truncate,) = logits(backend, Span(0, 24, TOKENS[24:32], all_logits=True))
        (copy_again,) = logits(backend, Span(1, 8, OTHER[20:26], all_logits=True))
    with opened(cls, infos["llama"]) as cold:
        logits(cold, Span(0, 0, prefix))
        (expected_1,) = logits(cold, Span(0, 16, rest_1, all_logits=True))
        cold.truncate(0, 16)
        logits(cold, Span(0, 16, rest_0))
        (expected_0,) = logits(cold, Span(0, 24, TOKENS[24:32], all_logits=True))
        cold.truncate(0, 0)
        logits(cold, Span(0, 0, prefix))
        cold.truncate(0, 8)  # the prefix was computed as one batch of 16, then cut
        (expected_copy,) = logits(cold, Span(0, 8, OTHER[20:26], all_logits=True))
    assert_close(expected_1, shared, SEQUENCE_KLD, "continued from a copied prefix vs computed")
    assert_close(expected_0, after_truncate, SEQUENCE_KLD, "the source after its copy was truncated")
    assert_close(expected_copy, copy_again, SEQUENCE_KLD, "the copy continued after its truncation")


def test_a_prefix_copied_into_the_sequence_evaluated_last_replaces_its_cells(cls, infos):
    # A backend that keeps the last sequence's cells where its kernels read them must not take the copy's
    # positions for the ones it holds; nor miss the cells of a token a step after a truncation. The cold run
    # takes the same batches, so that only the cells can differ (llama.cpp's single-token rows differ from a
    # batch's by up to 2.4e-3 here, a third of the smallest top-1 margin).
    prefix, rest = TOKENS[:16], OTHER[:12]

    def continued(backend: Backend, seq: int) -> tuple[np.ndarray, np.ndarray]:
        (batch,) = logits(backend, Span(seq, 16, rest, all_logits=True))
        backend.truncate(seq, 20)
        return batch, np.stack([logits(backend, Span(seq, 20 + i, [token]))[0] for i, token in enumerate(rest[4:])])

    with opened(cls, infos["llama"], n_seq=2) as backend:
        logits(backend, Span(0, 0, prefix))
        logits(backend, Span(1, 0, OTHER[40:70]))  # sequence 1 last: its 30 cells where the kernels read
        backend.copy_prefix(0, 1, 16)
        copied, stepped = continued(backend, 1)
    with opened(cls, infos["llama"]) as cold:
        logits(cold, Span(0, 0, prefix))
        expected, expected_steps = continued(cold, 0)
    assert_close(expected, copied, SEQUENCE_KLD, "continued from a prefix copied over the last sequence")
    assert_close(expected_steps, stepped, SEQUENCE_KLD, "a token a step after a truncation")


def test_only_sequences_below_n_seq_exist(cls, infos):
    with opened(cls, infos["llama"], n_seq=2) as backend:
        n = backend.n_seq
        assert n == 2, f"n_seq {n}, asked for 2"
        logits(backend, Span(0, 0, TOKENS[:4]))
        calls = {
            "eval": lambda seq: backend.eval([Span(seq, 0, TOKENS[:1])]),
            "truncate": lambda seq: backend.truncate(seq, 0),
            "evict": lambda seq: backend.evict(seq, 0, 1),
            "copy_prefix to": lambda seq: backend.copy_prefix(0, seq, 1),
            "copy_prefix from": lambda seq: backend.copy_prefix(seq, 1, 0),
        }
        for what, call in calls.items():
            for seq in (n, -1):
                with pytest.raises(BackendError) as exc:
                    call(seq)
                assert str(seq) in one_line(exc), f"{what}({seq}): {exc.value}"
        with pytest.raises(BackendError) as exc:  # two spans of one sequence in one call
            backend.eval([Span(1, 0, TOKENS[:2]), Span(1, 2, TOKENS[2:4])])
        one_line(exc)
        for span in (Span(1, 0, TOKENS[:2], follow=2), Span(1, 0, TOKENS[:2], True, True, 2)):  # follow: argmax only
            with pytest.raises(BackendError) as exc:
                backend.eval([span])
            assert "follow" in one_line(exc)
        # Nothing above was done: sequence 0 still holds its 4 positions, sequence 1 none.
        logits(backend, Span(0, 4, TOKENS[4:5]), Span(1, 0, TOKENS[:1]))


# -- close ----------------------------------------------------------------------------------------


def test_close_twice_does_nothing_and_any_later_call_is_a_clear_error(cls, infos):
    backend = cls(infos["llama"], BackendOptions(kv_tokens=64, threads=2, n_seq=2))
    logits(backend, Span(0, 0, TOKENS[:8]))
    backend.close()
    backend.close()
    calls = {
        "eval": lambda: backend.eval([Span(0, 8, TOKENS[8:9])]),
        "truncate": lambda: backend.truncate(0, 4),
        "evict": lambda: backend.evict(0, 1, 2),
        "copy_prefix": lambda: backend.copy_prefix(0, 1, 4),
    }
    for what, call in calls.items():
        with pytest.raises(BackendError) as exc:
            call()
        assert "closed" in one_line(exc), f"{what}: {exc.value}"


# -- through the engine: cancel and NaN -----------------------------------------------------------


def long_prompt(n_words: int) -> str:
    words = np.random.default_rng(3).choice(["the", "cat", "in", "a", "hat", "sat", "on", "stone"], size=n_words)
    return " ".join(words)


def test_cancel_before_iterating_evaluates_nothing(cls, tiny):
    with Engine(tiny["llama"], backend=cls.name, kv_budget="8192tok", threads=2, batch_size=8) as engine:
        stream = engine.stream(long_prompt(200), max_tokens=8, temperature=0)
        stream.cancel()
        result = drain(stream)
        assert result.finish_reason == "cancelled" and result.tokens == []
        assert engine.kv_used == 0


def test_cancel_mid_prefill_stops_between_chunks_and_leaves_the_engine_sound(cls, tiny):
    # 5,500 prompt tokens in chunks of 4: a prefill of a second or more, which the cancel,
    # sent as soon as the first chunk is in the cache, must cut short.
    prompt = long_prompt(2600)
    options = {"backend": cls.name, "kv_budget": "8192tok", "threads": 2, "batch_size": 4}
    with Engine(tiny["llama"], **options) as engine:
        n_prompt = len(engine.tokenize(prompt))
        assert n_prompt > 5000
        stream = engine.stream(prompt, max_tokens=8, temperature=0)
        worker = threading.Thread(target=drain, args=(stream,))
        worker.start()
        deadline = time.monotonic() + 60
        while engine.kv_used == 0 and time.monotonic() < deadline:  # the prefill has begun
            time.sleep(0.0005)
        stream.cancel()
        worker.join(60)
        assert not worker.is_alive()
        result = stream.result
        assert result is not None and result.finish_reason == "cancelled" and result.tokens == []
        assert 0 < engine.kv_used < n_prompt, f"{engine.kv_used} of {n_prompt} prompt tokens evaluated"
        after = engine.generate("the cat sat on", max_tokens=8, temperature=0, ignore_eos=True)
    with Engine(tiny["llama"], **options) as fresh:
        cold = fresh.generate("the cat sat on", max_tokens=8, temperature=0, ignore_eos=True)
    assert after.tokens == cold.tokens and len(cold.tokens) == 8


def test_an_argmax_span_gives_its_row_or_the_rows_greedy_token(cls, infos):
    """``Span.argmax``: a backend may answer with the last row's argmax alone (a device spares the row's trip);
    either way greedy takes the same token. A row that is not finite stays recognisable as such."""
    with opened(cls, infos["llama"]) as backend:
        logits(backend, Span(0, 0, TOKENS[:20]))
        for tokens in (TOKENS[20:21], TOKENS[20:24]):  # a decode step, and a span whose last row counts
            (row,) = logits(backend, Span(0, 20, tokens))
            backend.truncate(0, 20)
            (answer,) = backend.eval([Span(0, 20, tokens, argmax=True)])
            backend.truncate(0, 20)
            if answer.ndim:
                assert np.array_equal(answer, row)
            else:
                assert answer.dtype == np.int64 and int(answer) == int(row.argmax())
    with opened(cls, infos["nan"]) as backend:
        (answer,) = backend.eval([Span(0, 0, TOKENS[:4], argmax=True)])
        assert int(answer) == ARGMAX_NOT_FINITE if answer.ndim == 0 else not np.isfinite(answer).all()


@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_nan_or_infinite_logits_are_a_backend_error(cls, tiny, infos, poison):
    with opened(cls, infos[poison]) as backend:  # the backend computes them; it need not judge them
        (row,) = logits(backend, Span(0, 0, TOKENS[:4]))
        assert not np.isfinite(row).all()
    with Engine(tiny[poison], backend=cls.name, kv_budget="256tok", threads=2) as engine:
        with pytest.raises(BackendError) as exc:
            engine.generate("the cat", max_tokens=4, temperature=0)
        assert "NaN" in one_line(exc) or "infinite" in str(exc.value)


def test_nan_that_appears_while_decoding_is_a_backend_error(cls, tmp_path):
    path = write_sharp_gguf(tmp_path / "decode-nan.gguf", tied=False)
    prompt = "the cat sat on"
    tokenizer = Tokenizer(path)
    try:
        tokens = tokenizer.encode(prompt)
    finally:
        tokenizer.close()
    with opened(backend_class("reference"), load_model_info(path), kv_type="f32") as ref:
        (row,) = logits(ref, Span(0, 0, tokens))
    first = int(row.argmax())
    assert first not in tokens and row[first] > 0  # so boosting its row makes it lead by more
    poison_token(path, first)
    with opened(cls, load_model_info(path)) as backend:  # the model is as meant: finite, then NaN
        (row,) = logits(backend, Span(0, 0, tokens))
        assert np.isfinite(row).all() and row.argmax() == first
        (row,) = logits(backend, Span(0, len(tokens), [first]))
        assert not np.isfinite(row).all()
        if cls.follows:  # going on greedily, it stops at the NaN's row
            backend.truncate(0, 0)
            (followed,) = backend.eval([Span(0, 0, tokens, argmax=True, follow=3)])
            assert followed.tolist() == [first, ARGMAX_NOT_FINITE]
    with Engine(path, backend=cls.name, kv_budget="256tok", threads=2) as engine:
        # Greedy, and the sampling chain (top_k=1 draws the same token, through the sampler's own path); greedy
        # again once the engine has timed its steps, which a backend that follows then follows.
        for options in (dict(temperature=0), dict(temperature=0.8, top_k=1, seed=0), dict(temperature=0)):
            with pytest.raises(BackendError) as exc:
                engine.generate(prompt, max_tokens=4, ignore_eos=True, **options)
            assert "NaN" in one_line(exc) or "infinite" in str(exc.value)
