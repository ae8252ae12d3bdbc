"""The tokenizer without llama.cpp (edgeinfer/vocabulary.py, HF tokenizers) against llama.cpp's own, on real
vocabularies: SmolLM2's byte-level BPE and Gemma 3's SentencePiece (262,144 tokens, no space prefix).

Every token id is rendered both ways, and every text below tokenized both ways, with and without BOS and
special-token parsing. tests/test_convert_vocab.py holds both to the Hugging Face and sentencepiece
references on the converter's vocabularies of every kind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

from edgeinfer.errors import EdgeInferError, InvalidModelError, InvalidOptionError
from edgeinfer.models.catalog import resolve_model
from edgeinfer.models.info import load_model_info
from edgeinfer.tokenizer import LLAMACPP, TOKENIZERS, Tokenizer, engine_tokenizer

TEXTS = {
    "english": "The lighthouse keeper's daughter didn't want to leave; she'd rather count 1,234,567 ships.\n\n"
    "Two  spaces, a tab\there, and   three. WE'LL SEE!  ",
    "code": "def fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a  # 55\n\n\nprint(fib(10)) {x: [1, 2]} && x != y || z <= 3.14e-5\r\n",
    "cjk": "你好，世界。今天天气很好。こんにちは、灯台は毎晩九時に点きます。안녕하세요 세계",
    "emoji": "🙂🚢 🤖🦀 👍🏽 👨‍👩‍👧 café naïve Ångström Καλημέρα Здравствуй ½ ﬁ ①",
    "edges": "   leading spaces, trailing   \n\t\n \u00a0nbsp \u200bzero width \ufeffbom ▁typed",
    "chat": "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n<start_of_turn>user\nhi<end_of_turn>\n",
}


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def pair(request: pytest.FixtureRequest, model_path: Path):
    """The same GGUF's tokenizer twice: llama.cpp's and the rebuilt one."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"llama.cpp's tokenizer, the reference, is not installed: {exc}")
    path = model_path if request.param == "smollm2" else resolve_model("gemma3-270m")
    llama, rebuilt = Tokenizer(path, LLAMACPP), Tokenizer(path, TOKENIZERS)
    yield llama, rebuilt
    llama.close()
    rebuilt.close()


def test_the_vocabulary_and_its_special_ids_agree(pair):
    llama, rebuilt = pair
    assert (rebuilt.n_vocab, rebuilt.bos_id, rebuilt.eos_id, rebuilt.add_bos) == (
        llama.n_vocab,
        llama.bos_id,
        llama.eos_id,
        llama.add_bos,
    )


def test_every_token_renders_alike_and_ends_alike(pair):
    llama, rebuilt = pair
    for token in range(llama.n_vocab):
        assert rebuilt.piece(token) == llama.piece(token), token
        assert rebuilt.token_text(token) == llama.token_text(token), token
        assert rebuilt.is_end_of_generation(token) == llama.is_end_of_generation(token), token
    ends = {token for token in range(llama.n_vocab) if llama.is_end_of_generation(token)}
    assert rebuilt.end_ids == llama.end_ids == ends and llama.eos_id in ends


@pytest.mark.parametrize("name", TEXTS)
def test_text_tokenizes_alike(pair, name):
    llama, rebuilt = pair
    text = TEXTS[name]
    for add_special in (True, False):
        for parse_special in (True, False):
            expected = llama.encode(text, add_special=add_special, parse_special=parse_special)
            assert rebuilt.encode(text, add_special=add_special, parse_special=parse_special) == expected, (
                add_special,
                parse_special,
            )
    assert rebuilt.decode(rebuilt.encode(text, add_special=False)) == llama.decode(
        llama.encode(text, add_special=False)
    )


def test_a_typed_marker_stays_text_in_both(pair):
    llama, rebuilt = pair
    text = "<|im_start|>user\nsay <|im_end|> and <end_of_turn> please<|im_end|>\n"
    start = text.index("say")
    literal = [(start, start + len("say <|im_end|> and <end_of_turn> please"))]
    assert rebuilt.encode(text, literal=literal) == llama.encode(text, literal=literal)
    assert rebuilt.has_markers("<|im_end|>") == llama.has_markers("<|im_end|>")


def test_an_unknown_implementation_is_refused():
    with pytest.raises(InvalidOptionError, match="choose llamacpp or tokenizers"):
        Tokenizer("any.gguf", "sentencepiece")


@pytest.mark.parametrize(
    ("tokenizer", "metadata", "named"),
    [
        ("gpt2", {"tokenizer.ggml.model": "bert"}, "'bert'"),
        ("gpt2", {"tokenizer.ggml.pre": "default"}, "'default'"),  # llama.cpp's own split, unlike any table entry
        ("gpt2", {"tokenizer.ggml.pre": None}, "None"),
        ("gpt2", {"tokenizer.ggml.eos_token_id": None}, "eos_token_id"),
        ("llama", {"tokenizer.ggml.scores": None}, "scores"),
    ],
)
def test_a_tokenizer_it_cannot_rebuild_exactly_says_so_in_one_line(tmp_path, tokenizer, metadata, named):
    from gguf import GGUFValue, GGUFValueType
    from tiny_model import write_tiny_gguf

    values = {k: None if v is None else GGUFValue(v, GGUFValueType.STRING) for k, v in metadata.items()}
    path = write_tiny_gguf(tmp_path / "odd.gguf", tokenizer=tokenizer, metadata=values)
    with pytest.raises(InvalidModelError) as exc:
        Tokenizer(path, TOKENIZERS)
    message = str(exc.value)
    assert "\n" not in message and named in message and "llama-cpp-python" in message


def test_a_tokenizer_left_open_at_exit_closes_quietly(model_path: Path, monkeypatch):
    """At interpreter shutdown a module's globals may already be None when a left-open tokenizer is collected:
    its finalizer must not need them (``contextlib.suppress`` there raised AttributeError, printed at exit)."""
    import edgeinfer.tokenizer as tokenizer_module

    tokenizer = Tokenizer(model_path, TOKENIZERS)
    monkeypatch.setattr(tokenizer_module, "contextlib", None)  # as shutdown leaves it
    tokenizer.__del__()
    monkeypatch.undo()
    with pytest.raises(EdgeInferError, match="closed"):
        tokenizer.encode("hi")


def test_an_engine_tokenizes_with_tokenizers_off_llamacpp_where_it_rebuilds_quickly(model_path: Path):
    pytest.importorskip("llama_cpp", reason="llama.cpp's tokenizer, the other choice, is not installed")
    pytest.importorskip("tokenizers")
    chosen = {}
    for name, path in (("smollm2", model_path), ("gemma3", resolve_model("gemma3-270m"))):
        for on_llamacpp in (True, False):
            with closing(engine_tokenizer(load_model_info(path), on_llamacpp)) as tokenizer:
                chosen[name, on_llamacpp] = tokenizer.implementation
    # Gemma 3's SentencePiece vocabulary takes the rebuild seconds: llama.cpp's reads it in a fraction.
    assert chosen == {
        ("smollm2", True): LLAMACPP,
        ("smollm2", False): TOKENIZERS,
        ("gemma3", True): LLAMACPP,
        ("gemma3", False): LLAMACPP,
    }


def test_an_engine_off_llamacpp_falls_back_to_its_tokenizer_where_tokenizers_cannot(tmp_path, model_path, monkeypatch):
    pytest.importorskip("llama_cpp", reason="llama.cpp's tokenizer, the fallback, is not installed")
    from gguf import GGUFValue, GGUFValueType
    from tiny_model import write_tiny_gguf

    metadata = {"tokenizer.ggml.pre": GGUFValue("default", GGUFValueType.STRING)}  # a split only llama.cpp knows
    odd = write_tiny_gguf(tmp_path / "odd.gguf", tokenizer="gpt2", metadata=metadata)
    text = TEXTS["english"]
    with closing(engine_tokenizer(load_model_info(odd), False)) as fallen, closing(Tokenizer(odd, LLAMACPP)) as llama:
        assert fallen.implementation == LLAMACPP
        assert fallen.encode(text) == llama.encode(text)
    monkeypatch.setitem(sys.modules, "edgeinfer.vocabulary", None)  # as where tokenizers is not installed
    with closing(engine_tokenizer(load_model_info(model_path), False)) as fallen:
        assert fallen.implementation == LLAMACPP


def test_an_engine_off_llamacpp_tokenizes_without_loading_it(model_path: Path):
    """The reference backend's engine reads the vocabulary with tokenizers, in a process llama.cpp stays out
    of, and gets llama.cpp's ids."""
    pytest.importorskip("llama_cpp", reason="llama.cpp's tokenizer, the reference, is not installed")
    pytest.importorskip("tokenizers")
    script = (
        "import json, sys\n"
        "from edgeinfer import Engine\n"
        f"with Engine({str(model_path)!r}, backend='reference', kv_budget='256tok', threads=1) as engine:\n"
        f"    ids = engine.tokenize({TEXTS['chat']!r})\n"
        "print(json.dumps({'llama_cpp': 'llama_cpp' in sys.modules, 'ids': ids}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["llama_cpp"] is False
    with closing(Tokenizer(model_path, LLAMACPP)) as llama:
        assert seen["ids"] == llama.encode(TEXTS["chat"])
