"""The converter's tokenizer half: a Hugging Face tokenizer, written into a GGUF, tokenizes in real
llama.cpp (through edgeinfer's tokenizer) exactly as the Hugging Face tokenizer, or sentencepiece,
does; what llama.cpp cannot reproduce is refused. So does edgeinfer's tokenizer without llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sentencepiece
from gguf import GGUFReader, GGUFWriter, TokenType
from hf_tokenizers import (
    CHATML,
    CHATML_SPECIALS,
    write_bpe_trained_with_byte_fallback,
    write_byte_level_bpe,
    write_gpt2_files,
    write_sentencepiece,
    write_sentencepiece_json,
    write_smollm2_from_gguf,
    write_unigram,
)
from tiny_hf import write_tiny_hf
from tiny_model import write_tiny_gguf
from tokenizers import Tokenizer as HFTokenizer

from edgeinfer.converters.convert import convert
from edgeinfer.converters.vocab import Vocab, read_vocab
from edgeinfer.errors import ConversionError, InvalidModelError
from edgeinfer.models.pretokenizers import PRE_TOKENIZERS
from edgeinfer.tokenizer import NORMALIZER_KEY, REMOVE_EXTRA_WHITESPACES_KEY, Tokenizer

ENGLISH = (
    "The lighthouse keeper's daughter didn't want to leave; she'd rather count 1,234,567 ships than sleep.\n"
    "Two  spaces, a tab\there,\n\nthen a blank line and   three spaces. WE'LL SEE!"
)
CODE = (
    "def fib(n: int) -> int:\n"
    '    """Return the n-th Fibonacci number."""\n'
    "    a, b = 0, 1\n"
    "    for _ in range(n):\n"
    "        a, b = b, a + b\n"
    "    return a\n\n"
    "print(fib(10))  # 55\n"
)
# Chinese, Greek and Russian as trained on; Japanese and 🤖 🦀 never seen (bytes, or the unknown token).
NON_LATIN = (
    "Καλημέρα κόσμε! 你好，世界。今天天气很好。 こんにちは、灯台は毎晩九時に点きます。 "
    "Здравствуй, мир 🙂🚢 🤖🦀 café naïve Ångström"
)
CHAT = "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n"
SAMPLES = [ENGLISH, CODE, NON_LATIN, CHAT]


def _gguf(path: Path, vocab: Vocab, **model: Any) -> Path:
    """A tiny model whose vocabulary is ``vocab``."""

    def add_vocab(writer: GGUFWriter) -> int:
        vocab.add_to(writer)
        return len(vocab.tokens)

    return write_tiny_gguf(path, add_vocab=add_vocab, **model)


@pytest.fixture(params=["llamacpp", "tokenizers"])
def llama_tokenizer(request):
    """Loads a GGUF's tokenizer: llama.cpp's, and the one rebuilt with HF tokenizers for machines without it,
    each held to the same references."""
    opened: list[Tokenizer] = []

    def load(path: Path) -> Tokenizer:
        opened.append(Tokenizer(path, request.param))
        return opened[-1]

    yield load
    for tokenizer in opened:
        tokenizer.close()


@pytest.mark.parametrize("pre", ["qwen2", "smollm", "llama-bpe", "gpt-2"])
def test_byte_level_bpe_tokenizes_as_hugging_face(tmp_path, llama_tokenizer, pre):
    write_byte_level_bpe(tmp_path, pre=pre)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    n_vocab = hf.get_vocab_size() + 37  # embeddings often have spare rows
    vocab = read_vocab(tmp_path, n_vocab)
    assert vocab.model == "gpt2" and vocab.pre == pre
    assert vocab.chat_template == CHATML

    llama = llama_tokenizer(_gguf(tmp_path / "model.gguf", vocab, arch="qwen2"))
    assert llama.n_vocab == n_vocab
    assert llama.add_bos == (pre == "llama-bpe")
    for text in SAMPLES:
        assert llama.encode(text) == hf.encode(text).ids, text
    for special in CHATML_SPECIALS:
        assert llama.encode(special, add_special=False) == [hf.token_to_id(special)]
    assert llama.eos_id == hf.token_to_id("<|im_end|>")


def test_sentencepiece_tokenizes_as_sentencepiece(tmp_path, llama_tokenizer):
    write_sentencepiece(tmp_path, vocab_size=512)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    vocab = read_vocab(tmp_path, 600)
    assert vocab.model == "llama" and vocab.pre is None and vocab.add_space_prefix is True

    llama = llama_tokenizer(_gguf(tmp_path / "model.gguf", vocab, arch="llama"))
    assert (llama.n_vocab, llama.bos_id, llama.eos_id, llama.add_bos) == (600, sp.bos_id(), sp.eos_id(), True)
    for text in (ENGLISH, CODE, NON_LATIN):
        assert llama.encode(text) == [sp.bos_id(), *sp.encode(text)], text
    # The ChatML markers were added after SentencePiece's 512 pieces. transformers (legacy mode, as
    # Llama 2's tokenizer is) encodes the text between them separately, a leading ▁ on each.
    im_start, im_end = 512, 513
    expected = [sp.bos_id(), im_start, *sp.encode("user\nHello there!"), im_end, *sp.encode("\n")]
    assert llama.encode("<|im_start|>user\nHello there!<|im_end|>\n") == expected
    assert llama.encode("<|im_end|>", add_special=False) == [im_end]


def test_every_recognised_pre_tokenizer_loads_in_llama_cpp(tmp_path, llama_tokenizer):
    write_byte_level_bpe(tmp_path, pre="qwen2")
    for pre in PRE_TOKENIZERS:
        vocab = read_vocab(tmp_path, 512, pre=pre.name)
        assert vocab.pre == pre.name
        assert llama_tokenizer(_gguf(tmp_path / f"{pre.name}.gguf", vocab, arch="qwen2")).encode("hello 123") != []


def test_chat_template_from_its_own_file(tmp_path):
    # transformers 5 saves the template in chat_template.jinja rather than tokenizer_config.json.
    write_byte_level_bpe(tmp_path, pre="qwen2")
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    vocab = read_vocab(tmp_path, 512)
    assert vocab.chat_template == "{{ messages[0]['content'] }}"


def _edit_tokenizer_json(folder: Path, **changes: object) -> None:
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if key == "model":
            data["model"].update(value)
        else:
            data[key] = value
    path.write_text(json.dumps(data), encoding="utf-8")


def test_unknown_pre_tokenizer_is_refused_naming_the_pattern(tmp_path):
    write_byte_level_bpe(tmp_path, pre="qwen2")
    pattern = r"\p{L}+|\p{N}+|[^\s\p{L}\p{N}]+"
    _edit_tokenizer_json(
        tmp_path,
        pre_tokenizer={
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
    )
    with pytest.raises(ConversionError) as error:
        read_vocab(tmp_path, 512)
    message = str(error.value)
    assert "not one llama.cpp implements" in message and json.dumps(pattern) in message
    assert "--pre-tokenizer" in message and "\n" not in message
    # The user can vouch for one.
    assert read_vocab(tmp_path, 512, pre="qwen2").pre == "qwen2"
    with pytest.raises(ConversionError, match="unknown pre-tokenizer 'qwen9'"):
        read_vocab(tmp_path, 512, pre="qwen9")


def test_merge_rule_mismatch_is_refused(tmp_path):
    # Llama 3's regex but merges applied to whole-token words too: llama.cpp's llama-bpe skips them.
    write_byte_level_bpe(tmp_path, pre="llama-bpe")
    _edit_tokenizer_json(tmp_path, model={"ignore_merges": False})
    vocab = read_vocab(tmp_path, 512)
    assert vocab.pre == "smaug-bpe"  # the same regex without ignore_merges
    write_byte_level_bpe(tmp_path, pre="qwen2")
    _edit_tokenizer_json(tmp_path, model={"ignore_merges": True})
    with pytest.raises(ConversionError, match="splits text like llama.cpp's 'qwen2'.*ignore_merges=true"):
        read_vocab(tmp_path, 512)


def test_normalizers_llama_cpp_cannot_apply_are_refused(tmp_path):
    write_byte_level_bpe(tmp_path, pre="qwen2")
    _edit_tokenizer_json(tmp_path, normalizer={"type": "Lowercase"})
    with pytest.raises(ConversionError, match=r"normalizes text with Lowercase\(\)"):
        read_vocab(tmp_path, 512)
    # NFC (Qwen2's) changes only text that is not NFC already: converted, with a note.
    _edit_tokenizer_json(tmp_path, normalizer={"type": "NFC"})
    assert "NFC" in read_vocab(tmp_path, 512).notes[0]


def test_padding_and_too_large_tokenizer(tmp_path):
    write_byte_level_bpe(tmp_path, pre="smollm", vocab_size=300)
    vocab = read_vocab(tmp_path, 320)
    assert len(vocab.tokens) == len(vocab.token_types) == 320
    assert vocab.tokens[300:] == [f"[PAD{i}]" for i in range(300, 320)]
    assert set(vocab.token_types[300:]) == {TokenType.UNUSED}
    with pytest.raises(ConversionError, match="the tokenizer has 300 tokens but the model's embedding has only 299"):
        read_vocab(tmp_path, 299)


def test_special_tokens_from_generation_config(tmp_path):
    write_byte_level_bpe(tmp_path, pre="qwen2")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    del config["eos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [2, 0]}))
    vocab = read_vocab(tmp_path, 512)
    assert (vocab.bos_id, vocab.eos_id, vocab.eot_id, vocab.pad_id) == (0, 2, 0, 0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9999}))
    with pytest.raises(ConversionError, match="generation_config.json gives eos_token_id 9999, outside"):
        read_vocab(tmp_path, 512)


def test_missing_tokenizer_lists_what_was_looked_for(tmp_path):
    with pytest.raises(ConversionError, match="looked for tokenizer.json, tokenizer.model .* vocab.json with merges"):
        read_vocab(tmp_path, 512)


def test_real_smollm2_vocabulary_converts_to_what_llama_cpp_made(tmp_path, model_path, llama_tokenizer):
    # SmolLM2's own tokenizer, rebuilt from the GGUF llama.cpp's converter made: converting it again
    # must give a vocabulary that tokenizes exactly as that GGUF and as Hugging Face's tokenizers do.
    write_smollm2_from_gguf(tmp_path, model_path)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    vocab = read_vocab(tmp_path, 49152)
    assert (vocab.pre, vocab.bos_id, vocab.eos_id, vocab.pad_id, vocab.add_bos) == ("smollm", 1, 2, 2, False)
    original = llama_tokenizer(model_path)
    converted = llama_tokenizer(
        write_tiny_gguf(
            tmp_path / "model.gguf", add_vocab=lambda w: vocab.add_to(w) or 49152, n_embd=64, n_head=1, n_ff=64
        )
    )
    for text in [
        *SAMPLES,
        "2024-06-01: 1234567 items at 3.14159 each",
        "x = [1, 2, 3]\n\tif a >= 10:\n\t\treturn 'ok'",
    ]:
        assert converted.encode(text) == original.encode(text) == hf.encode(text).ids, text


def test_malformed_tokenizer_files_are_one_line_errors(tmp_path):
    write_byte_level_bpe(tmp_path, pre="qwen2")
    _edit_tokenizer_json(tmp_path, added_tokens=[{"id": 3}])
    with pytest.raises(ConversionError, match="tokenizer files in .* are malformed"):
        read_vocab(tmp_path, 512)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ConversionError, match="tokenizer.json is not valid JSON"):
        read_vocab(tmp_path, 512)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"\xff\x00 not a protobuf")
    with pytest.raises(ConversionError, match="tokenizer.model is not a SentencePiece model"):
        read_vocab(tmp_path, 512)


# --- SentencePiece in tokenizer.json, Unigram, GPT-2's vocab.json and merges.txt ----------------


@pytest.mark.parametrize("style", ["llama", "mistral", "gemma"])
def test_sentencepiece_tokenizer_json_tokenizes_as_hugging_face(tmp_path, llama_tokenizer, style):
    hf = write_sentencepiece_json(tmp_path, style)
    assert not (tmp_path / "tokenizer.model").exists()
    vocab = read_vocab(tmp_path, hf.get_vocab_size() + 11)
    assert (vocab.model, vocab.pre, vocab.add_space_prefix, vocab.add_bos) == ("llama", None, style != "gemma", True)
    # Gemma's converter put "\t" where SentencePiece has <0x09>; llama.cpp falls back to it as well.
    assert vocab.token_types.count(TokenType.BYTE) == (255 if style == "gemma" else 256)
    assert vocab.token_types[hf.token_to_id("<unk>")] == TokenType.UNKNOWN
    assert vocab.token_types[hf.token_to_id("<s>")] == TokenType.CONTROL
    assert (vocab.bos_id, vocab.eos_id) == (hf.token_to_id("<s>"), hf.token_to_id("</s>"))

    llama = llama_tokenizer(_gguf(tmp_path / "model.gguf", vocab, arch="llama"))
    for text in (ENGLISH, CODE, NON_LATIN):
        assert llama.encode(text) == hf.encode(text).ids, text
    if style == "mistral":
        # Metaspace's prepend_scheme "first": what llama.cpp cannot do is noted, not hidden.
        assert any("starts with a space" in note for note in vocab.notes)
        assert any("after a special token" in note for note in vocab.notes)
    else:
        assert vocab.notes == []
        assert llama.encode(CHAT) == hf.encode(CHAT).ids
        assert llama.encode(" a leading space") == hf.encode(" a leading space").ids


def test_bpe_with_byte_fallback_not_made_from_sentencepiece_is_refused(tmp_path):
    # Hugging Face's trainer makes a token from one pair only; llama.cpp merges any pair that spells it.
    write_bpe_trained_with_byte_fallback(tmp_path)
    with pytest.raises(ConversionError, match=r"no merge .* though they spell the token .*tokenizer\.model$"):
        read_vocab(tmp_path, 1024)


def test_sentencepiece_json_spacing_llama_cpp_cannot_do_is_refused(tmp_path):
    write_sentencepiece_json(tmp_path, "llama")
    _edit_tokenizer_json(tmp_path, normalizer={"type": "Lowercase"})
    with pytest.raises(ConversionError, match=r"normalizes text with Lowercase\(\) and pre-tokenizes it with None"):
        read_vocab(tmp_path, 1024)
    _edit_tokenizer_json(tmp_path, normalizer=None, pre_tokenizer=None)
    with pytest.raises(ConversionError, match="only makes each space ▁"):
        read_vocab(tmp_path, 1024)
    _edit_tokenizer_json(tmp_path, model={"byte_fallback": False})
    with pytest.raises(ConversionError, match="holds a BPE model that is neither"):
        read_vocab(tmp_path, 1024)


@pytest.mark.parametrize("normalizer", ["none", "nmt_nfkc", "nmt_nfkc+fold"])
def test_unigram_tokenizes_as_hugging_face(tmp_path, llama_tokenizer, normalizer):
    nmt_nfkc, fold = normalizer.startswith("nmt_nfkc"), normalizer.endswith("fold")
    hf = write_unigram(tmp_path, nmt_nfkc=nmt_nfkc, fold=fold)
    vocab = read_vocab(tmp_path, hf.get_vocab_size() + 7)
    assert (vocab.model, vocab.add_space_prefix, vocab.add_bos, vocab.add_eos) == ("t5", True, False, True)
    assert (vocab.unk_id, vocab.eos_id) == (hf.token_to_id("<unk>"), hf.token_to_id("</s>"))
    assert (bool(vocab.precompiled_charsmap), vocab.remove_extra_whitespaces) == (nmt_nfkc, fold)

    llama = llama_tokenizer(_gguf(tmp_path / "model.gguf", vocab, arch="llama"))
    compatibility = "ＦＵＬＬ ｗｉｄｔｈ ① ﬁne ½ ㍻"  # what NFKC changes, where the normalizer applies
    spaces = "  two leading, three   inside and two trailing  "
    for text in (ENGLISH, CODE, NON_LATIN, compatibility, *([spaces] if fold else [])):
        assert llama.encode(text) == hf.encode(text).ids, text
    assert hf.token_to_id("<unk>") in hf.encode(NON_LATIN).ids  # unseen characters: one unknown token a run
    # Metaspace alone puts no ▁ before text that starts with a space and llama.cpp does: noted. Folded, both drop it.
    assert any("starts with a space" in note for note in vocab.notes) != fold


def test_unigram_llama_cpp_cannot_reproduce_is_refused(tmp_path):
    write_unigram(tmp_path)
    _edit_tokenizer_json(tmp_path, model={"byte_fallback": True})
    with pytest.raises(ConversionError, match="Unigram falls back to bytes"):
        read_vocab(tmp_path, 1024)
    write_unigram(tmp_path)
    data = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    data["model"]["vocab"].append(["a\u2581b", -9.0])  # a piece across a word boundary, which Metaspace never reaches
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ConversionError, match="split=true.*'a▁b'"):
        read_vocab(tmp_path, 1024)
    write_unigram(tmp_path)
    _edit_tokenizer_json(tmp_path, normalizer={"type": "NFKC"})
    with pytest.raises(ConversionError, match=r"normalizes text with NFKC\(\)"):
        read_vocab(tmp_path, 1024)
    write_unigram(tmp_path)
    _edit_tokenizer_json(tmp_path, model={"unk_id": None})
    with pytest.raises(ConversionError, match="no unknown token"):
        read_vocab(tmp_path, 1024)


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2"])
def test_vocab_json_and_merges_txt_tokenize_as_hugging_face(tmp_path, llama_tokenizer, pre):
    hf = write_gpt2_files(tmp_path, pre=pre)
    assert not (tmp_path / "tokenizer.json").exists()
    vocab = read_vocab(tmp_path, hf.get_vocab_size() + 3)
    assert (vocab.model, vocab.pre, vocab.eos_id) == ("gpt2", pre, hf.token_to_id("<|im_end|>"))
    assert {vocab.token_types[hf.token_to_id(s)] for s in CHATML_SPECIALS} == {TokenType.CONTROL}

    llama = llama_tokenizer(_gguf(tmp_path / "model.gguf", vocab, arch="qwen2"))
    for text in SAMPLES:
        assert llama.encode(text) == hf.encode(text).ids, text


def test_vocab_json_of_an_unknown_tokenizer_class_needs_the_pre_tokenizer(tmp_path):
    write_gpt2_files(tmp_path, pre="gpt-2")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["tokenizer_class"] = "CodeGenTokenizer"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ConversionError, match="tokenizer class CodeGenTokenizer.*pass --pre-tokenizer NAME"):
        read_vocab(tmp_path, 1024)
    assert read_vocab(tmp_path, 1024, pre="gpt-2").pre == "gpt-2"
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b c\n", encoding="utf-8")
    with pytest.raises(ConversionError, match="merges.txt has 'a b c', not a pair"):
        read_vocab(tmp_path, 1024, pre="gpt-2")


# --- SentencePiece's nmt_nfkc normalizer, applied by edgeinfer ----------------------------------

# What sentencepiece normalizes: outer, repeated and odd whitespace, line breaks, control characters,
# compatibility forms, decomposed accents, a byte-order mark, a ▁ typed in the text.
NORMALIZED = [
    "",
    "   ",
    "\n\n",
    "  leading and trailing  ",
    " \u3000ideographic\u00a0no-break\u2003em space ",
    "x\x01y\x7fz control",
    "line\r\nbreaks\tand\u2028separators",
    "ＦＵＬＬ ｗｉｄｔｈ ① ﬁne ½ ㍻ ™",
    "cafe\u0301 e\u0301",
    "\ufeffbyte order mark",
    "zero\u200bwidth",
    "\u2581typed",
]


@pytest.mark.parametrize("rule", ["nmt_nfkc", "identity"])
def test_sentencepiece_normalizer_tokenizes_as_sentencepiece(tmp_path, llama_tokenizer, rule):
    # nmt_nfkc folds whitespace too, as the trainer's defaults have it; so does this identity.
    write_sentencepiece(tmp_path, normalization=rule, fold_whitespace=True)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    vocab = read_vocab(tmp_path, 600)
    assert (vocab.model, vocab.normalizer, vocab.remove_extra_whitespaces) == ("llama", rule, True)
    assert len(vocab.notes) == 1 and NORMALIZER_KEY in vocab.notes[0] and "Ollama" in vocab.notes[0]

    path = _gguf(tmp_path / "model.gguf", vocab, arch="llama")
    fields = GGUFReader(path).fields
    assert fields[NORMALIZER_KEY].contents() == rule
    assert fields[REMOVE_EXTRA_WHITESPACES_KEY].contents() is True
    llama = llama_tokenizer(path)
    for text in (ENGLISH, CODE, NON_LATIN, *NORMALIZED):
        assert llama.encode(text) == [sp.bos_id(), *sp.encode(text)], repr(text)
    # transformers encodes the text between special tokens on its own, each stretch normalized.
    im_start, im_end = 512, 513
    expected = [sp.bos_id(), im_start, *sp.encode("user\n  Hello there! "), im_end, *sp.encode("\n")]
    assert llama.encode("<|im_start|>user\n  Hello there! <|im_end|>\n") == expected

    # What llama.cpp, ignoring the key, makes of the same vocabulary: other ids wherever normalizing changes the text.
    vocab.normalizer = None
    plain = llama_tokenizer(_gguf(tmp_path / "plain.gguf", vocab, arch="llama"))
    assert plain.encode(CODE) != llama.encode(CODE)
    assert plain.encode("plain words") == llama.encode("plain words")


@pytest.mark.parametrize("tokenizer", ["nmt_nfkc", "tokenizer.json", "unigram"])
def test_a_converted_checkpoint_tokenizes_as_its_tokenizer(tmp_path, llama_tokenizer, tokenizer):
    hf = tmp_path / "hf"
    write_tiny_hf(hf, tokenizer="spm")  # an embedding of 517 rows
    (hf / "tokenizer.model").unlink()
    texts = (ENGLISH, CODE, NON_LATIN)
    if tokenizer == "nmt_nfkc":
        write_sentencepiece(hf, normalization="nmt_nfkc")
        sp = sentencepiece.SentencePieceProcessor(model_file=str(hf / "tokenizer.model"))
        expected = {text: [sp.bos_id(), *sp.encode(text)] for text in texts}
    else:
        reference = write_sentencepiece_json(hf, "llama", 512) if tokenizer == "tokenizer.json" else write_unigram(hf)
        expected = {text: reference.encode(text).ids for text in texts}
    notes: list[str] = []
    convert(hf, tmp_path / "model.gguf", qtype="q8_0", log=notes.append)
    llama = llama_tokenizer(tmp_path / "model.gguf")
    for text in texts:
        assert llama.encode(text) == expected[text], text
    # The report tells the user what other runtimes will not apply.
    other_runtimes = [line for line in notes if line.startswith("note: tokenizer.model normalizes text")]
    assert len(other_runtimes) == (tokenizer == "nmt_nfkc") and all("llama.cpp" in line for line in other_runtimes)


def test_sentencepiece_normalizers_edgeinfer_cannot_apply_are_refused(tmp_path):
    write_sentencepiece(tmp_path, normalization="nfkc")
    with pytest.raises(ConversionError, match="normalizes text with the rule 'nfkc'; edgeinfer applies nmt_nfkc"):
        read_vocab(tmp_path, 600)


def test_a_normalizer_sentencepiece_does_not_know_is_a_one_line_error(tmp_path):
    write_sentencepiece(tmp_path, normalization="nmt_nfkc")
    vocab = read_vocab(tmp_path, 600)
    vocab.normalizer = "nmt_nfkc_v9"  # as a GGUF from a future converter might ask
    path = _gguf(tmp_path / "model.gguf", vocab, arch="llama")
    with pytest.raises(InvalidModelError, match=r"'nmt_nfkc_v9' .* does not know; run: pip install -U sentencepiece$"):
        Tokenizer(path)
