"""The kernel probe through real llama.cpp, and a budgeted plan that weighs what it measured against quality."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from edgeinfer.converters.plan import MIX_TYPES, QUALITY_INSISTS, budgeted, stored_bytes
from edgeinfer.converters.quantize import available
from edgeinfer.converters.type_speed import RUNS, TypeSpeed, measure_type_speeds, probe_hparams, slow_types
from edgeinfer.models.arch import ARCHITECTURES, HParams

SMALL = HParams(
    arch=ARCHITECTURES["llama"],
    n_vocab=1000,
    n_embd=96,
    n_layer=30,
    n_head=3,
    n_head_kv=1,
    head_dim=32,
    n_ff=160,
    n_ctx_train=2048,
    rope_base=10_000.0,
    rms_eps=1e-5,
    tied_embeddings=True,
)


def test_every_type_a_mix_chooses_from_loads_and_runs_in_the_probe():
    types = [t for t in MIX_TYPES if available(t)]
    seen = []
    speeds = measure_type_speeds(types, SMALL, threads=1, progress=lambda done, total: seen.append((done, total)))
    runs = RUNS * len(types)
    assert list(speeds) == types and seen[0] == (0, runs) and seen[-1] == (runs, runs) and len(seen) == runs + 1
    probe = probe_hparams(SMALL)
    assert (probe.n_embd, probe.n_ff, probe.n_layer) == (256, 256, 2)  # whole blocks of 256, whatever the width
    for speed in speeds.values():
        assert math.isfinite(speed.prefill) and speed.prefill > 0 and math.isfinite(speed.decode) and speed.decode > 0
        assert speed.probe_params == 2 * (256 * 256 * 2 + 256 * 64 * 2 + 3 * 256 * 256)


def test_the_probe_keeps_heads_a_multiple_of_kv_heads_as_llama_cpp_needs():
    # SmolLM2-360M's shape: 960 wide, 15 heads, 5 KV heads. Its probe is 1024 wide, 16 heads: 5 does not divide
    # 16 (llama.cpp would abort), so the probe takes the divisor nearest the model's share, 4.
    wide = dataclasses.replace(SMALL, n_embd=960, n_head=15, n_head_kv=5, head_dim=64, n_ff=2560)
    probe = probe_hparams(wide)
    assert (probe.n_embd, probe.n_head, probe.n_head_kv, probe.n_ff) == (1024, 16, 4, 2560)
    assert set(measure_type_speeds([QType.Q4_0], wide, threads=1)) == {QType.Q4_0}
    # A 7B model's width is probed at MAX_PROBE_WIDTH, the FFN narrowed alike.
    seven = dataclasses.replace(SMALL, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=11008)
    assert (probe_hparams(seven).n_embd, probe_hparams(seven).n_ff, probe_hparams(seven).n_head_kv) == (1024, 2816, 4)


def _speeds(prefill: dict[QType, float], decode: float = 100.0) -> dict[QType, TypeSpeed]:
    return {t: TypeSpeed(t, p, decode, probe_params=1000) for t, p in prefill.items()}


def test_a_type_is_slow_only_beside_one_no_larger_that_is_faster_at_both():
    speeds = _speeds({QType.Q4_0: 200.0, QType.Q4_1: 100.0, QType.Q8_0: 180.0, QType.F16: 90.0})
    slow = slow_types(speeds)
    # Q4_1 is larger than Q4_0 and half as fast; F16 beside Q4_0 too. Q8_0 is within SLOW_FACTOR of Q4_0.
    assert slow == {QType.Q4_1: [QType.Q4_0], QType.F16: [QType.Q4_0, QType.Q8_0]}
    # Q4_0 now decodes slower: nothing is slow beside it, and Q8_0, larger than Q4_1, does not count for it.
    speeds[QType.Q4_0] = TypeSpeed(QType.Q4_0, 200.0, 50.0, 1000)
    assert slow_types(speeds) == {QType.F16: [QType.Q8_0]}


@pytest.mark.parametrize("q4_0_error, avoided", [(1.1, True), (2.0, False)])
def test_a_slow_type_is_left_out_of_the_mix_unless_quality_insists(q4_0_error, avoided):
    shapes = {"a.weight": (512, 512), "b.weight": (512, 512), "norm": (512,)}
    errors = {QType.Q4_0: q4_0_error, QType.Q4_1: 1.0, QType.Q8_0: 0.1}

    def errors_of(name: str, types: list[QType]) -> dict[QType, float]:
        return {t: errors.get(t, math.inf) for t in types}

    # Room for Q4_1 twice, not for Q8_0 beside Q4_0: error alone chooses Q4_1 for both.
    budget = 2 * stored_bytes((512, 512), QType.Q4_1) + stored_bytes((512,), QType.F32)
    by_error, none = budgeted(shapes, budget, errors_of)
    assert none is None and {by_error[n].qtype for n in ("a.weight", "b.weight")} == {QType.Q4_1}

    speeds = _speeds({QType.Q4_0: 200.0, QType.Q4_1: 100.0, QType.Q8_0: 180.0})
    plan, trade = budgeted(shapes, budget, errors_of, speeds)
    assert trade is not None
    chosen = {plan[n].qtype for n in ("a.weight", "b.weight")}
    if avoided:  # 10% more estimated error, within QUALITY_INSISTS, for twice the prefill speed
        assert chosen == {QType.Q4_0} and trade.avoided == {QType.Q4_1: QType.Q4_0} and not trade.kept
        assert trade.error_ratio == pytest.approx(1.1) and trade.error_ratio <= QUALITY_INSISTS
        assert trade.speedup == pytest.approx(2.0)
    else:  # twice the error: quality insists
        assert chosen == {QType.Q4_1} and not trade.avoided and trade.kept == {QType.Q4_1: pytest.approx(2.0)}
        assert trade.error_ratio == 1.0 and trade.speedup == 1.0


def test_a_lookup_table_keeps_its_slow_type():
    # An untied embedding is read a row a token: its type's matmul speed does not matter.
    shapes = {"token_embd.weight": (512, 512), "a.weight": (512, 512)}

    def errors_of(name: str, types: list[QType]) -> dict[QType, float]:
        return {t: {QType.Q4_0: 1.1, QType.Q4_1: 1.0}.get(t, math.inf) for t in types}

    budget = 2 * stored_bytes((512, 512), QType.Q4_1)
    speeds = _speeds({QType.Q4_0: 200.0, QType.Q4_1: 100.0})
    plan, trade = budgeted(shapes, budget, errors_of, speeds, lookups=frozenset({"token_embd.weight"}))
    assert plan["token_embd.weight"].qtype == QType.Q4_1 and plan["a.weight"].qtype == QType.Q4_0
    assert trade is not None and trade.avoided == {QType.Q4_1: QType.Q4_0}
    assert np.isclose(trade.speedup, 2.0)


def test_a_mix_without_error_keeps_its_types_whatever_their_speed():
    # Weights a type holds exactly (a checkpoint dequantized from Q4_1): every other type adds error to none.
    shapes = {"a.weight": (512, 512)}

    def errors_of(name: str, types: list[QType]) -> dict[QType, float]:
        return {t: {QType.Q4_0: 1e-3, QType.Q4_1: 0.0}.get(t, math.inf) for t in types}

    speeds = _speeds({QType.Q4_0: 200.0, QType.Q4_1: 100.0})
    plan, trade = budgeted(shapes, stored_bytes((512, 512), QType.Q4_1), errors_of, speeds)
    assert plan["a.weight"].qtype == QType.Q4_1
    assert trade is not None and not trade.avoided and trade.kept == {QType.Q4_1: math.inf}
