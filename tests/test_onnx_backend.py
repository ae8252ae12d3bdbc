"""The ONNX Runtime backend beyond the conformance suite (which it runs too): agreement on real weights over
512 tokens, the graph cache on disk, what it refuses, a failure inside ONNX Runtime, and the Engine on it."""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import threading
import time
import warnings
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from conformance_models import kld, top1
from gguf import GGUFReader
from tiny_model import write_tiny_gguf

from edgeinfer import BackendError, BackendUnavailableError, Engine, InvalidOptionError
from edgeinfer import engine as engine_module
from edgeinfer.backends import backend_status
from edgeinfer.backends.base import BackendOptions, Span, check_options
from edgeinfer.backends.onnx import graph
from edgeinfer.backends.onnx.activations import FLOAT, INT8, INT8_KLD_LIMIT
from edgeinfer.backends.onnx.backend import OnnxRuntimeBackend
from edgeinfer.backends.onnx.graph_cache import cached_graph, chosen_accuracy_level, graph_path, weights_path
from edgeinfer.backends.onnx.spec import BUILDER_VERSION, GraphSpec, activations
from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.models.info import ModelInfo, load_model_info
from edgeinfer.tokenizer import Tokenizer

from support import reference_copies

TEXT = (Path(__file__).parent / "data" / "lighthouse.txt").read_text()
TOKENS = [int(t) for t in np.random.default_rng(3).integers(3, 250, size=64)]


def options(**changes: object) -> BackendOptions:
    return BackendOptions(**{"kv_tokens": 128, "kv_type": "f16", "threads": 2, "batch_size": 64, **changes})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ModelInfo:
    return load_model_info(write_tiny_gguf(tmp_path_factory.mktemp("onnx") / "tiny.gguf"))


def logits_of(cls: type, info: ModelInfo, tokens: list[int], kv_type: str, **load: object) -> np.ndarray:
    backend = cls(info, options(kv_tokens=len(tokens), batch_size=len(tokens), kv_type=kv_type), **load)
    try:
        (rows,) = backend.eval([Span(0, 0, tokens, all_logits=True)])
        return np.array(rows)
    finally:
        backend.close()


@pytest.fixture(scope="module")
def smollm2_copies(tmp_path_factory: pytest.TempPathFactory, model_path: Path):
    """SmolLM2 with every matrix as F32 and as Q8_0, 512 tokens of text, and the reference's logits of them."""
    return reference_copies(tmp_path_factory.mktemp("smollm2-copies"), model_path, ("f32", "q8_0"))


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_f32_and_q8_0_copies_of_smollm2_agree_with_the_reference_over_512_tokens(smollm2_copies, kind):
    """Issue 17's bound: top-1 >= 99% and mean KLD <= 0.001, with an f16 cache, the coarser of its two (the default
    is f32). Measured: F32 1.4e-7, 100%; Q8_0 1.2e-6, 100%. The Q8_0 copy's first load finds that one int8 pass
    moves it too far (2.9e-3 over the calibration text) and keeps two: in one, as llama.cpp computes it, SmolLM2 lost
    2.65e-3, 96.9% here (llama.cpp 2.57e-3 to 2.76e-3)."""
    tokens, copies = smollm2_copies
    info, truth = copies[kind]
    ours = logits_of(OnnxRuntimeBackend, info, tokens, "f16")
    divergence, agree = kld(truth, ours), top1(truth, ours)
    assert divergence <= 1e-3 and agree >= 0.99, f"KLD {divergence:.2e}, top-1 {agree:.3f}"
    assert chosen_accuracy_level(info) == (FLOAT if kind == "q8_0" else None)  # F32: nothing to measure


def residual_passes(info: ModelInfo, level: int) -> tuple[int, int]:
    """The products of ``info``'s graph at ``level``, and how many of them take a second pass."""
    from edgeinfer.models.tensors import open_tensors

    with open_tensors(info) as tensors:
        model = graph.build_graph(info, tensors, GraphSpec("f32", level))
    products = [node.name for node in model.graph.node if node.op_type == "MatMulNBits"]
    second = [name for name in products if name.endswith(".second_pass")]
    return len(products) - len(second), len(second)


def test_an_exact_graph_takes_every_q8_0_product_in_two_int8_passes_and_an_int8_one_in_one(tmp_path):
    from conformance_models import write_sharp_gguf

    info = load_model_info(write_sharp_gguf(tmp_path / "q8_0.gguf", tensor_type="Q8_0", n_embd=256, n_ff=512))
    products = 4 * info.hparams.n_layer + 1  # Q, K and V in one, the attention's output, gate and up, down; the head
    assert residual_passes(info, FLOAT) == (products, products)
    assert residual_passes(info, INT8) == (products, 0)
    # As the first load's line and the build's progress say it, for what the file holds.
    assert activations(info, FLOAT) == "two int8 passes for Q8_0" and activations(info, INT8) == "int8 activations"
    f32 = load_model_info(write_tiny_gguf(tmp_path / "f32.gguf"))
    assert activations(f32, FLOAT) == "float activations"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: Q, K and V have biases, added once
def test_q8_0_in_two_int8_passes_computes_what_the_file_holds(tmp_path, monkeypatch, arch):
    """The sharpened tiny model, which one int8 pass moves by KLD 8.9e-4 and 9.9e-4, to within float rounding
    (measured: 1.4e-8 and 1.2e-8)."""
    from conformance_models import write_sharp_gguf

    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path))
    path = write_sharp_gguf(tmp_path / "q8_0.gguf", arch=arch, tensor_type="Q8_0", n_embd=256, n_ff=512, n_head=4)
    info = load_model_info(path)
    truth = logits_of(ReferenceBackend, info, TOKENS, "f32")
    ours = logits_of(OnnxRuntimeBackend, info, TOKENS, "f32", accuracy_level=FLOAT)
    divergence, agree = kld(truth, ours), top1(truth, ours)
    assert divergence <= 1e-6 and agree == 1.0, f"KLD {divergence:.2e}, top-1 {agree:.3f}"


def test_the_graph_is_built_once_and_a_damaged_one_is_rebuilt(tiny, caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path))
    spec = GraphSpec("f16", 0)
    path = graph_path(tiny, spec)
    assert not path.exists()
    version = path.name.split("-")[1]
    stale = path.with_name(path.name.replace(f"-{version}-", f"-v{BUILDER_VERSION - 1}-"))
    path.parent.mkdir(parents=True)
    stale.write_bytes(b"an older builder's graph")
    abandoned = path.parent / f".{path.name}.killed"  # a build folder whose process died a week ago
    abandoned.mkdir()
    os.utime(abandoned, (time.time() - 7 * 86400,) * 2)
    weights_path(path).write_bytes(b"weights left without their graph")  # replaced, even from the cwd
    monkeypatch.chdir(path.parent)
    with caplog.at_level(logging.INFO, logger="edgeinfer.backends.onnx"):
        backend = OnnxRuntimeBackend(tiny, options())
    built = [r.message for r in caplog.records if "layer" in r.message]
    assert built[-1].endswith(f"layer {tiny.hparams.n_layer} of {tiny.hparams.n_layer}")  # progress, layer by layer
    try:
        (first,) = backend.eval([Span(0, 0, TOKENS)])
        first = first.copy()
    finally:
        backend.close()
    weights = weights_path(path)
    assert path.exists() and weights.exists() and path.with_name(path.name + ".sha256").exists()
    assert weights.stat().st_size > path.stat().st_size  # the weights live beside the graph, not in it
    assert not list(path.parent.glob(".*"))  # written atomically, nothing left behind
    assert not stale.exists() and not abandoned.exists()  # an older builder's graph, a dead build: gone

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="edgeinfer.backends.onnx"):
        assert cached_graph(tiny, spec) == path
    assert not caplog.records  # found, not built again

    for damaged in (weights, path):
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF  # one flipped bit in the middle: it might still load, and compute wrong
        damaged.write_bytes(bytes(data))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="edgeinfer.backends.onnx"):
            backend = OnnxRuntimeBackend(tiny, options())
        assert any("damaged" in r.message for r in caplog.records), damaged.name
        try:
            (again,) = backend.eval([Span(0, 0, TOKENS)])
        finally:
            backend.close()
        np.testing.assert_array_equal(first, again)

    path.write_bytes(path.read_bytes()[:100])  # cut short
    backend = OnnxRuntimeBackend(tiny, options())
    try:
        (cut,) = backend.eval([Span(0, 0, TOKENS)])
        np.testing.assert_array_equal(first, cut)
    finally:
        backend.close()

    digests = path.with_name(path.name + ".sha256")
    digests.unlink()
    digests.mkdir()  # a folder where its digests were: damaged too, and said in one line, not a traceback
    with pytest.raises(InvalidOptionError) as exc:
        OnnxRuntimeBackend(tiny, options())
    assert "\n" not in str(exc.value) and str(tmp_path / "onnx") in str(exc.value)


def test_a_kv_type_gets_its_own_graph(tiny):
    assert graph_path(tiny, GraphSpec("f16", 0)) != graph_path(tiny, GraphSpec("f32", 0))
    assert graph_path(tiny, GraphSpec("f16", 0)) != graph_path(tiny, GraphSpec("f16", 4))


def outlying_norms(path: Path) -> Path:
    """Make the first of every 32 weights of each norm 300 times larger (in place): one activation in each block
    of 32 then dwarfs the rest, which int8 activations, one scale a block, round to nothing."""
    reader = GGUFReader(path, "r+")
    for tensor in reader.tensors:
        if tensor.name.endswith("norm.weight"):
            tensor.data[::32] *= 300
    reader.data.flush()
    del reader
    return path


@pytest.mark.parametrize(
    ("tensor_type", "outliers", "chosen"),
    [("Q4_0", False, INT8), ("Q4_0", True, FLOAT), ("Q8_0", False, INT8), ("Q8_0", True, FLOAT)],
)
def test_int8_activations_are_kept_only_for_a_model_they_move_little(
    tmp_path, monkeypatch, caplog, tensor_type, outliers, chosen
):
    """Measured here, KLD of int8 activations from exact ones: Q4_0 5.4e-6 on the plain model, 0.17 with outliers;
    Q8_0, held to LOSSLESS_KLD_LIMIT, 6.4e-6 and 0.20."""
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "model.gguf", tensor_type=tensor_type, n_embd=256, n_ff=512, n_head=4)
    info = load_model_info(outlying_norms(path) if outliers else path)
    with caplog.at_level(logging.INFO, logger="edgeinfer.backends.onnx"):
        assert OnnxRuntimeBackend.accuracy_level(info, options()) == chosen
    (said,) = [r.message for r in caplog.records if "int8 activations move it" in r.message]
    assert f"{activations(info, chosen)} kept" in said
    other = INT8 if chosen == FLOAT else FLOAT
    assert graph_path(info, GraphSpec("f16", chosen)).exists()
    assert not graph_path(info, GraphSpec("f16", other)).exists()  # measured with, then removed: no disk spent

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="edgeinfer.backends.onnx"):
        truth = logits_of(ReferenceBackend, info, TOKENS, "f32")
        ours = logits_of(OnnxRuntimeBackend, info, TOKENS, "f32")  # another KV type: only its graph is built
    assert not any("measuring" in r.message for r in caplog.records)  # the choice is kept, not made again
    # Float activations compute what the file holds; two int8 passes leave about 1/250 of one pass's error, which
    # these outliers make large (measured: 4.8e-5, the second pass's own rounding more than the kernels' sums).
    exact = 1e-6 if tensor_type == "Q4_0" else 3e-4
    assert kld(truth, ours) <= (INT8_KLD_LIMIT if chosen == INT8 else exact)

    record = next((tmp_path / "cache" / "onnx").glob("*-activations.json"))
    record.write_bytes(b"\xff not json")  # damaged: measured again, not trusted
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="edgeinfer.backends.onnx"):
        assert OnnxRuntimeBackend.accuracy_level(info, options()) == chosen
    assert any("measuring" in r.message for r in caplog.records)

    lock = record.with_name(record.name + ".lock")
    lock.unlink(missing_ok=True)
    lock.mkdir()  # no lock can be taken there: a cache that is only read (read-only, say) still gives its choice
    assert OnnxRuntimeBackend.accuracy_level(info, options()) == chosen
    lock.rmdir()
    kept = record.read_text()
    for level in ("99", "-1", "1" + "0" * 30, "true", "4.0"):  # no level MatMulNBits is built with here
        record.write_text(kept.replace(f'"accuracy_level": {chosen}', f'"accuracy_level": {level}'))
        assert chosen_accuracy_level(info) is None
    record.write_text("[" * 100_000 + "]" * 100_000)  # nested past Python's recursion limit
    assert chosen_accuracy_level(info) is None


def test_a_model_without_4_bit_or_q8_0_codes_is_not_measured(tiny, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="edgeinfer.backends.onnx"):
        assert OnnxRuntimeBackend.accuracy_level(tiny, options()) == FLOAT  # F32: the level changes nothing
    assert not caplog.records and not (tmp_path / "onnx").exists()


HOLD_THE_LOCK = """
import sys
from filelock import FileLock
from edgeinfer.backends.onnx.spec import GraphSpec
from edgeinfer.backends.onnx.graph_cache import _build, graph_path
from edgeinfer.models.info import load_model_info
info = load_model_info(sys.argv[1])
path = graph_path(info, GraphSpec("f16", 0))
with FileLock(str(path) + ".lock"):
    print("held", flush=True)
    sys.stdin.readline()
    _build(info, GraphSpec("f16", 0), path)
"""


def test_a_graph_another_process_is_building_is_waited_for_not_built_twice(tiny, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path))
    path = graph_path(tiny, GraphSpec("f16", 0))
    path.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_LOCK, str(tiny.path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        found: list[Path] = []
        with caplog.at_level(logging.INFO, logger="edgeinfer.backends.onnx"):
            waiter = threading.Thread(target=lambda: found.append(cached_graph(tiny, GraphSpec("f16", 0))))
            waiter.start()
            deadline = time.monotonic() + 60
            while not any("waiting" in r.message for r in caplog.records) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert waiter.is_alive() and not path.exists()  # waiting, not building beside the other process
            holder.stdin.write("build\n")
            holder.stdin.flush()
            waiter.join(timeout=120)
        assert found == [path] and holder.wait(timeout=60) == 0
        assert not any(r.message.startswith("building") for r in caplog.records)  # the other process's graph, loaded
    finally:
        holder.kill()


class CountedSession:
    """An ONNX Runtime session that counts its runs (the backend's own, passed through)."""

    def __init__(self, session) -> None:
        self.session, self.runs = session, 0

    def run_with_iobinding(self, binding) -> None:
        self.runs += 1
        self.session.run_with_iobinding(binding)

    def io_binding(self):
        return self.session.io_binding()


def test_sequences_decoding_a_token_each_run_as_one_batch_around_an_idle_one(tiny):
    """Three sequences: 0 and 2 step together, in one run, while 1, between them, holds its tokens; then a full
    sequence between them (no free cell for the batch to write to) sends the step back to one run a sequence.
    Every row and every later step matches a backend that ran each sequence alone."""
    prompts = {0: TOKENS[:9], 1: TOKENS[20:33], 2: TOKENS[40:61]}
    steps = [{0: TOKENS[10 + i], 2: TOKENS[34 + i]} for i in range(4)]

    def decode(backend, together: bool) -> tuple[list[np.ndarray], int]:
        for seq, prompt in prompts.items():
            backend.eval([Span(seq, 0, prompt)])
        counted = backend._session = CountedSession(backend._session)
        rows = []
        for i, step in enumerate(steps):
            spans = [Span(seq, len(prompts[seq]) + i, [token]) for seq, token in step.items()]
            for batch in [spans] if together else [[span] for span in spans]:
                rows += [row.copy() for row in backend.eval(batch)]
        (last,) = backend.eval([Span(1, len(prompts[1]), [TOKENS[5]])])  # the idle one goes on as if alone
        return [*rows, last.copy()], counted.runs

    with closing(OnnxRuntimeBackend(tiny, options(kv_tokens=96, n_seq=3))) as backend:
        batched, runs = decode(backend, together=True)
    with closing(OnnxRuntimeBackend(tiny, options(kv_tokens=96, n_seq=3))) as backend:
        alone, alone_runs = decode(backend, together=False)
    assert runs == len(steps) + 1 and alone_runs == 2 * len(steps) + 1
    for i, (expected, actual) in enumerate(zip(alone, batched, strict=True)):
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4, err_msg=f"row {i}")

    with closing(OnnxRuntimeBackend(tiny, options(kv_tokens=96, n_seq=3))) as backend:
        backend.eval([Span(1, 0, TOKENS[:32])])  # its region of 32 cells, full
        backend.eval([Span(0, 0, prompts[0]), Span(2, 0, prompts[2])])
        backend._session = counted = CountedSession(backend._session)
        full = [row.copy() for row in backend.eval([Span(0, 9, [steps[0][0]]), Span(2, 21, [steps[0][2]])])]
    assert counted.runs == 2  # one a sequence
    for expected, actual in zip(alone[:2], full, strict=True):
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("level", "runs"), [(INT8, 1), (FLOAT, 2)])
def test_4_bit_codes_batch_sequences_only_with_int8_activations(tmp_path, level, runs):
    """MLAS's float path for 4-bit codes dequantizes for more than one row: two rows took 1.6x to 3.6x as long
    as one (docs/BENCHMARKS.md), so sequences then run one by one, and agree either way."""
    info = load_model_info(write_tiny_gguf(tmp_path / "q4_0.gguf", tensor_type="Q4_0", n_embd=256, n_head=4))
    with closing(OnnxRuntimeBackend(info, options(n_seq=2), accuracy_level=level)) as backend:
        backend.eval([Span(0, 0, TOKENS[:5]), Span(1, 0, TOKENS[10:17])])
        (alone,) = [row.copy() for row in backend.eval([Span(1, 7, [TOKENS[17]])])]
        backend.truncate(1, 7)
        backend._session = counted = CountedSession(backend._session)
        _, together = backend.eval([Span(0, 5, [TOKENS[5]]), Span(1, 7, [TOKENS[17]])])
    assert counted.runs == runs
    np.testing.assert_allclose(together, alone, rtol=0, atol=1e-3 if level == INT8 else 1e-4)


def test_a_tensor_type_it_has_no_form_for_is_one_line_naming_it(tmp_path):
    path = write_tiny_gguf(tmp_path / "ternary.gguf", tensor_type="TQ2_0", n_embd=256, n_ff=512, n_head=4)
    info = load_model_info(path)
    reason = OnnxRuntimeBackend.supports(info)
    assert reason is not None and "TQ2_0" in reason and "\n" not in reason
    with pytest.raises(BackendUnavailableError) as exc:
        Engine(path, backend="onnxruntime", kv_budget="256tok", threads=2)
    message = str(exc.value)
    assert "TQ2_0" in message and "\n" not in message
    runners = [name for name, state in backend_status(info).items() if name != "onnxruntime" and state == "available"]
    assert runners and f"{' and '.join(runners)} can: use --backend auto" in message  # llama.cpp, the reference


def test_one_token_steps_and_longer_spans_take_turns_on_a_sequence(tiny):
    """A one-token step writes its inputs into arrays bound once; a longer span binds its own. Turns between
    them, on two sequences, each give the row the reference gives at that position."""
    truth = logits_of(ReferenceBackend, tiny, TOKENS, "f32")
    cuts = [0, 8, 9, 10, 13, 14, 15, 20, 21]  # spans of 8, 1, 1, 3, 1, 1, 5, 1
    with closing(OnnxRuntimeBackend(tiny, options(kv_type="f32", n_seq=2))) as backend:
        for start, end in itertools.pairwise(cuts):
            for seq in (0, 1):  # the other sequence's turn between: its binding is its own
                (row,) = backend.eval([Span(seq, start, TOKENS[start:end])])
                assert kld(truth[end - 1 : end], row[None]) < 1e-6, f"sequence {seq}, tokens {start} to {end}"


def greedy_one_by_one(backend: OnnxRuntimeBackend, prompt: list[int], n: int) -> list[int]:
    """The argmax of the prompt's last row, then of each row after evaluating the token before: n tokens."""
    backend.truncate(0, 0)
    (row,) = backend.eval([Span(0, 0, prompt)])
    tokens = [int(np.argmax(row))]
    while len(tokens) < n:
        (row,) = backend.eval([Span(0, len(prompt) + len(tokens) - 1, tokens[-1:])])
        tokens.append(int(np.argmax(row)))
    backend.truncate(0, 0)
    return tokens


def test_a_followed_span_returns_the_greedy_tokens_and_holds_all_but_the_last(model_path):
    """``Span.follow``: the backend goes on greedily itself. Its tokens are the ones a token a step gives, bit for
    bit (the same one-token runs); it stops after a token in ``ends``, and where the sequence's cells run out."""
    with closing(Tokenizer(model_path)) as tokenizer:
        prompt = tokenizer.encode(TEXT)[:8]
    with closing(OnnxRuntimeBackend(load_model_info(model_path), options(kv_type="f32", kv_tokens=24))) as backend:
        expected = greedy_one_by_one(backend, prompt, 17)
        (followed,) = backend.eval([Span(0, 0, prompt, argmax=True, follow=5)])
        assert followed.dtype == np.int64 and followed.tolist() == expected[:6]
        # It holds the prompt and the five tokens it evaluated: the next step starts at 13, with the sixth.
        (row,) = backend.eval([Span(0, 13, expected[5:6])])
        assert int(np.argmax(row)) == expected[6]
        with pytest.raises(BackendError):
            backend.eval([Span(0, 13, expected[5:6])])
        # The tenth token as an end token: following stops at its first place from the eighth on, whatever the words.
        end = expected.index(expected[9], 7)
        span = Span(0, 14, expected[6:7], argmax=True, follow=9, ends=frozenset(expected[end : end + 1]))
        (followed,) = backend.eval([span])
        assert followed.tolist() == expected[7 : end + 1]  # the end token is returned, not evaluated
        (followed,) = backend.eval([Span(0, 14 + end - 6, expected[end : end + 1], argmax=True, follow=50)])
        assert followed.tolist() == expected[end + 1 : 17]  # up to the 24th cell, the last
        with pytest.raises(BackendError):
            backend.eval([Span(0, 24, [1])])  # full


def test_a_failure_while_following_changes_nothing(tiny):
    with closing(OnnxRuntimeBackend(tiny, options(kv_type="f32"))) as backend:
        expected = greedy_one_by_one(backend, TOKENS[:8], 6)
        backend.eval([Span(0, 0, TOKENS[:8])])
        session, runs = backend._session, []

        def third_run_fails(binding: object, *args: object) -> None:
            runs.append(binding)
            return session.run_with_iobinding(session.io_binding() if len(runs) == 3 else binding, *args)

        backend._session = type("FailingSession", (), {"run_with_iobinding": staticmethod(third_run_fails),
                                                       "io_binding": session.io_binding})()  # fmt: skip
        with pytest.raises(BackendError):
            backend.eval([Span(0, 8, expected[:1], argmax=True, follow=4)])
        backend._session = session
        (followed,) = backend.eval([Span(0, 8, expected[:1], argmax=True, follow=4)])
        assert followed.tolist() == expected[1:6]


def test_a_lone_greedy_answer_is_followed_and_is_the_answer_a_token_a_step_gives(tiny, monkeypatch):
    """Once the engine has timed a step, a lone greedy answer's backend draws several tokens a call: the same
    answer, the same cache, told the model's end tokens unless the answer ignores them; a stop string mid-step
    gives back the cells of the tokens after it."""
    answers = {}
    for follow_s in (0.0, engine_module.FOLLOW_S):
        monkeypatch.setattr(engine_module, "FOLLOW_S", follow_s)
        with Engine(tiny.path, backend="onnxruntime", kv_budget="128tok", threads=2, speculative="off") as engine:
            spans: list[Span] = []
            engine.backend.eval = lambda batch, real=engine.backend.eval, seen=spans: seen.extend(batch) or real(batch)
            engine.generate("the cat", max_tokens=4, temperature=0)  # the step is timed
            spans.clear()
            plain = engine.generate("the cat", max_tokens=40, temperature=0, ignore_eos=True)
            calls, followed = len(spans), [span for span in spans if span.follow]
            stop = plain.text[len(plain.text) // 2 :][:3]
            engine.reset()
            spans.clear()
            stopped = engine.generate("the cat", max_tokens=40, temperature=0, stop=[stop])
            answers[follow_s] = (plain.tokens, plain.text, stopped.tokens, stopped.text, engine.kv_used)
        if follow_s:
            assert calls < len(plain.tokens) / 2 and all(span.ends == frozenset() for span in followed)
            ends = {span.ends for span in spans if span.follow}
            assert ends == {engine.tokenizer.end_ids} and engine.tokenizer.end_ids
        assert plain.metrics.drafted_tokens == 0 and stopped.finish_reason == "stop"
    assert answers[0.0] == answers[engine_module.FOLLOW_S]


def test_a_greedy_answer_is_not_drafted_so_its_text_is_the_same_run_to_run(tiny, monkeypatch):
    """A drafted step rounds its batch of rows otherwise than one token a run; following comes and goes with the
    steps' timing. A greedy answer on this backend is therefore never drafted from its prompt: with lookup (the
    default) or without, following or not, it is the same tokens."""
    answers = []
    for follow_s in (0.0, engine_module.FOLLOW_S):
        monkeypatch.setattr(engine_module, "FOLLOW_S", follow_s)
        for speculative in ("lookup", "off"):
            with Engine(tiny.path, backend="onnxruntime", kv_budget="128tok", threads=2, speculative=speculative) as e:
                for _ in range(2):  # the second once the engine has timed its steps
                    result = e.generate("the cat the cat the cat", max_tokens=40, temperature=0, ignore_eos=True)
                    assert result.metrics.drafted_tokens == 0
                    answers.append(result.tokens)
    assert all(tokens == answers[0] for tokens in answers)


def test_a_model_trained_on_millions_of_positions_gets_rope_tables_of_2_to_the_17(tmp_path):
    """16M positions of RoPE tables took 8 GiB, a graph protobuf cannot write (an internal error); the tables stop
    at 131,072 positions, and a cache of more is one line naming the fix."""
    path = write_tiny_gguf(tmp_path / "long.gguf", n_ctx=16_000_000)
    with Engine(path, backend="onnxruntime", kv_budget="256tok", threads=2) as engine:
        assert len(engine.generate("the cat", max_tokens=3, temperature=0, ignore_eos=True).tokens) == 3
    with pytest.raises(InvalidOptionError) as exc:
        Engine(path, backend="onnxruntime", kv_budget="200000tok", threads=2)
    message = str(exc.value)
    assert "\n" not in message and "at most 131,072 positions" in message and "--kv-budget" in message
    # A model trained on fewer holds as many as it was trained on (the engine never asks for more).
    short = load_model_info(write_tiny_gguf(tmp_path / "short.gguf", n_ctx=64))
    with pytest.raises(InvalidOptionError, match="at most 64 positions of short.gguf, not 128"):
        OnnxRuntimeBackend(short, options(kv_tokens=128))


def test_a_failure_inside_onnx_runtime_is_a_backend_error_that_changes_nothing(tiny):
    backend = OnnxRuntimeBackend(tiny, options(kv_tokens=128))
    try:
        (last,) = backend.eval([Span(0, 0, TOKENS)])
        last = last.copy()
        session = backend._session
        real = session.run_with_iobinding
        session.run_with_iobinding = lambda binding, *args: real(session.io_binding(), *args)  # ONNX Runtime's error
        with pytest.raises(BackendError) as exc:
            backend.eval([Span(0, 64, [5])])
        assert "\n" not in str(exc.value) and "ONNX Runtime" in str(exc.value)
        del session.run_with_iobinding
        backend.eval([Span(0, 64, [5])])  # the sequence holds its 64 positions, as before the failure
        backend.truncate(0, 63)
        (again,) = backend.eval([Span(0, 63, TOKENS[-1:])])
        np.testing.assert_allclose(again, last, rtol=0, atol=1e-5)
    finally:
        backend.close()


def test_a_failure_inside_onnx_runtime_mid_decode_fails_the_call_and_the_next_one_starts_clean(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    with Engine(path, backend="onnxruntime", kv_budget="64tok", threads=2, speculative="off") as engine:
        cold = engine.generate("The", max_tokens=6, temperature=0, ignore_eos=True)
        engine.reset()
        session = engine.backend._session  # type: ignore[attr-defined]
        real, runs = session.run_with_iobinding, []

        def third_run_fails(binding: object, *args: object) -> None:
            runs.append(binding)  # the prompt's run, a decode step, then ONNX Runtime's own error on nothing bound
            return real(session.io_binding() if len(runs) == 3 else binding, *args)

        session.run_with_iobinding = third_run_fails
        with pytest.raises(BackendError) as exc:
            engine.generate("The", max_tokens=6, temperature=0, ignore_eos=True)
        assert "\n" not in str(exc.value) and "ONNX Runtime failed mid-evaluation" in str(exc.value)
        del session.run_with_iobinding
        again = engine.generate("The", max_tokens=6, temperature=0, ignore_eos=True)
        assert again.tokens == cold.tokens and again.metrics.cached_tokens == 0


def test_info_lists_every_execution_provider_and_a_device_is_named_by_a_part_of_it(tmp_path):
    import onnxruntime as ort

    listed = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "info", "--json"], capture_output=True, text=True, timeout=120
    )
    assert listed.returncode == 0, listed.stderr
    # The CPU's is "cpu" here; Azure's calls a cloud endpoint and runs no graph: not a device.
    elsewhere = ("CPUExecutionProvider", "AzureExecutionProvider")
    computing = [p for p in ort.get_available_providers() if p not in elsewhere]
    for provider in computing:
        assert provider in listed.stdout
        part = provider.removesuffix("ExecutionProvider").lower()
        assert check_options(OnnxRuntimeBackend, options(device=part)).device == provider
    assert check_options(OnnxRuntimeBackend, options(device="CPU")).device == "cpu"  # not "falling back to the CPU"
    assert check_options(OnnxRuntimeBackend, options(device="CPUExecutionProvider")).device == "cpu"  # its own name
    for refused in (str(len(computing)), "no such provider", "azure"):  # an index past the last
        with pytest.raises(InvalidOptionError, match="has no device"):
            check_options(OnnxRuntimeBackend, options(device=refused))


def test_a_part_of_several_devices_names_is_refused_naming_them(monkeypatch):
    import onnxruntime as ort

    listed = ["CUDAExecutionProvider", "TensorrtExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(ort, "get_available_providers", lambda: listed)
    assert check_options(OnnxRuntimeBackend, options(device="tensorrt")).device == "TensorrtExecutionProvider"
    with pytest.raises(InvalidOptionError) as exc:
        check_options(OnnxRuntimeBackend, options(device="executionprovider"))
    assert "CUDAExecutionProvider, TensorrtExecutionProvider" in str(exc.value) and "\n" not in str(exc.value)


def test_a_provider_that_cannot_start_here_falls_back_to_the_cpu_in_one_line(tmp_path, monkeypatch, caplog, capsys):
    # onnxruntime-gpu on a machine whose GPU or CUDA is missing lists CUDA and cannot start it: ONNX Runtime then
    # runs on the CPU. Listed here as such a build lists it; ONNX Runtime itself knows it is not there, leaves it out
    # with a warning of its own, and runs on the CPU.
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA really is available here")
    available = ort.get_available_providers()
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *available])
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    with caplog.at_level(logging.WARNING, logger="edgeinfer"), warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing of ONNX Runtime's own on top of the note
        engine = Engine(path, backend="onnxruntime", device="cuda", kv_budget="64tok", threads=2)
    with engine:
        assert engine.backend._session.get_providers() == ["CPUExecutionProvider"]  # type: ignore[attr-defined]
        assert len(engine.generate("The", max_tokens=3, temperature=0, ignore_eos=True).tokens) == 3
    notes = [r.getMessage() for r in caplog.records if "CUDAExecutionProvider" in r.getMessage()]
    assert len(notes) == 1 and "running on the CPU" in notes[0] and "\n" not in notes[0], notes
    assert capsys.readouterr().out == ""


def test_the_engine_runs_on_it_from_chat_to_stop(model_path):
    with Engine(model_path, backend="onnxruntime", kv_budget="512tok", threads=2) as engine:
        assert type(engine.backend).__name__ == "OnnxRuntimeBackend"
        result = engine.chat([{"role": "user", "content": "Name three colours."}], max_tokens=24, seed=1)
        assert result.tokens and result.finish_reason in ("stop", "length") and result.text.strip()
        engine.reset()  # the greedy run evaluates its whole prompt at once, as the replay below does
        greedy = engine.generate("The capital of France is", max_tokens=8, temperature=0, ignore_eos=True)
        assert len(greedy.tokens) == 8
        # Each greedy token is the argmax of the backend's rows as the engine asked for them: the prompt in one
        # evaluation, then a token a step. The same evaluations give the same rows, bit for bit. Scored in one
        # batch instead, rows round differently (with int8 activations by up to a logit), and a near-tie could go
        # either way.
        engine.reset()
        prompt = engine.tokenize("The capital of France is")
        (row,) = engine.backend.eval([Span(0, 0, prompt)])
        for i, token in enumerate(greedy.tokens):
            assert int(np.argmax(row)) == token, f"greedy token {i}"
            (row,) = engine.backend.eval([Span(0, len(prompt) + i, [token])])


WITHOUT_LLAMA_CPP = """
import sys
import threading
import time
sys.modules["llama_cpp"] = None  # as on a machine where llama-cpp-python is not installed
from edgeinfer import Engine
with Engine(sys.argv[1], kv_budget="512tok", threads=2) as engine:
    print(engine.backend.name, engine.tokenizer.implementation)
    print(" ".join(map(str, engine.tokenize(sys.argv[2]))))
"""


# A load that finds its graph built: onnx (0.8 s to import, ml_dtypes the most of it) is for building alone.
LOADS_BUILT = """
import sys
from edgeinfer import Engine
with Engine(sys.argv[1], backend="onnxruntime", kv_budget="128tok", threads=2) as engine:
    assert len(engine.generate("hello", max_tokens=2, temperature=0, ignore_eos=True).tokens) == 2
print(sorted(m for m in sys.modules if m == "onnx" or m.startswith("onnx.")))
"""


def test_a_load_that_finds_its_graph_built_does_not_import_onnx(tiny):
    with Engine(tiny.path, backend="onnxruntime", kv_budget="128tok", threads=2) as engine:  # builds it
        assert engine.kv_type == "f32"
    done = subprocess.run(
        [sys.executable, "-c", LOADS_BUILT, str(tiny.path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_its_cache_is_f32_by_default_and_f16_on_request(tiny):
    """ONNX Runtime's CPU attention has no fast f16 kernel; an engine's cache is of its backend's first KV type."""
    budget = int(OnnxRuntimeBackend.kv_bytes_per_token(tiny, "f32") * 100)
    cells = {}
    for kv_type in (None, "f32", "f16"):
        with Engine(tiny.path, backend="onnxruntime", kv_type=kv_type, kv_budget=budget, threads=2) as engine:
            cells[kv_type] = engine.kv_type, engine.capacity
            assert len(engine.generate("hello", max_tokens=3, temperature=0, ignore_eos=True).tokens) == 3
    assert cells[None] == cells["f32"] == ("f32", 100)
    assert cells["f16"] == ("f16", 200)  # the same bytes hold twice the cells
    with Engine(tiny.path, backend="reference", kv_budget="128tok", threads=2) as engine:
        assert engine.kv_type == "f16"


def test_without_llama_cpp_auto_runs_onnxruntime_and_tokenizes_as_llama_cpp(model_path):
    text = "Hello, world! 你好 🙂 def f(x): return x**2"
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_LLAMA_CPP, str(model_path), text], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    chosen, tokens = done.stdout.strip().splitlines()
    assert chosen == "onnxruntime tokenizers"
    with Engine(model_path, backend="onnxruntime", kv_budget="512tok", threads=2) as engine:
        assert [int(t) for t in tokens.split()] == engine.tokenize(text)


# Every type the graph maps, on the sharpened tiny model, against the reference, with float activations
# throughout: the graph then computes what the file holds, to rounding (measured below 1e-6). The backend
# runs codes of 5 and 6 bits with int8 activations for speed, as llama.cpp does, which costs 2e-4 to 5e-3
# on this deliberately sensitive model (Q8_0 takes a second pass, tested above); a wrong mapping costs 0.1 and more.
TYPES = ["F16", "BF16", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q2_K", "Q3_K", "IQ4_NL"]
TYPES += ["IQ4_XS"]


@pytest.mark.parametrize("type_name", TYPES)
def test_every_mapped_type_agrees_with_the_reference(tmp_path, monkeypatch, type_name):
    import tiny_model
    from conformance_models import write_sharp_gguf
    from gguf import GGMLQuantizationType

    from edgeinfer.converters import quantize

    qtype = GGMLQuantizationType[type_name]
    if not quantize.available(qtype):
        pytest.skip(f"{type_name} blocks come from ggml's quantizer, which needs llama.cpp's library")
    monkeypatch.setattr(tiny_model, "quantize", quantize.quantize)  # ggml's quantizers: gguf-py lacks K-quants
    monkeypatch.setattr(graph, "EIGHT_BIT_ACCURACY_LEVEL", 0)
    monkeypatch.setenv("EDGEINFER_CACHE_DIR", str(tmp_path))  # graphs built here, with float activations
    path = write_sharp_gguf(tmp_path / f"{type_name}.gguf", tensor_type=type_name, n_embd=256, n_ff=512, n_head=4)
    info = load_model_info(path)
    assert OnnxRuntimeBackend.supports(info) is None
    truth = logits_of(ReferenceBackend, info, TOKENS, "f32")
    ours = logits_of(OnnxRuntimeBackend, info, TOKENS, "f32", accuracy_level=FLOAT)
    divergence, agree = kld(truth, ours), top1(truth, ours)
    assert divergence <= 1e-6 and agree == 1.0, f"KLD {divergence:.2e}, top-1 {agree:.3f}"


def test_a_second_conversation_copies_the_shared_system_prompt_where_there_is_room(model_path):
    """The ONNX Runtime backend copies a shared prefix (it cannot share cells), so the engine makes room for the
    copy, or computes the prefix afresh where none can be made; either way the answer is a cold run's."""
    system = {"role": "system", "content": TEXT[:700]}  # about 150 tokens: two whole 64-token chunks shared
    first = [system, {"role": "user", "content": "What did the keeper see?"}]
    second = [system, {"role": "user", "content": "Who wrote the letters?"}]
    options = dict(max_tokens=24, temperature=0, ignore_eos=True)
    for budget, sequences in (("448tok", 3), ("256tok", 2)):
        with Engine(model_path, backend="onnxruntime", kv_budget=budget, sequences=sequences, threads=2) as engine:
            engine.chat(first, **options)
            warm = engine.chat(second, **options)
            assert engine.kv_used <= engine.capacity
        with Engine(model_path, backend="onnxruntime", kv_budget=budget, sequences=sequences, threads=2) as engine:
            cold = engine.chat(second, **options)
        assert warm.tokens == cold.tokens, budget
