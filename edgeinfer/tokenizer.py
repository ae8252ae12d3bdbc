"""The tokenizer: llama.cpp's own, loaded vocab-only from the GGUF, or the same vocabulary tokenized by Hugging
Face ``tokenizers`` as llama.cpp would (``edgeinfer/vocabulary.py``).

Either way every backend sees exactly the token ids llama.cpp would, pre-tokenizer quirks included.
tokenizers' is used where llama-cpp-python is not installed (a machine that runs only the ONNX Runtime
backend), and first (``engine_tokenizer``) for a byte-level BPE vocabulary in an engine whose backend does not
run on llama.cpp: loading llama.cpp to tokenize would bring its libraries and the GPU drivers it opens into
that process (46 MiB of RSS beside the ONNX Runtime backend, and llama.cpp's start-up).

Any thread may call it, also while another closes it: the native vocabulary is used
and freed under one lock, so a call after ``close()`` is a clear error, never a
freed pointer.

A SentencePiece model that normalizes text before tokenizing (the trainer's default
``nmt_nfkc``: NFKC, control characters dropped, line breaks and tabs made spaces, and
whitespace folded) is converted with its rule in two GGUF keys that llama.cpp ignores:
``edgeinfer.tokenizer.normalizer`` (the rule's name) and
``edgeinfer.tokenizer.remove_extra_whitespaces`` (whether leading and trailing whitespace
is dropped and runs of it become one space). This tokenizer applies them, with
sentencepiece's own normalizer, before llama.cpp tokenizes, so its ids are SentencePiece's.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from edgeinfer.errors import (
    NATIVE_LOAD_ERRORS,
    BackendUnavailableError,
    EdgeInferError,
    InvalidModelError,
    InvalidOptionError,
)

if TYPE_CHECKING:
    from edgeinfer.models.info import ModelInfo
    from edgeinfer.vocabulary import GGUFVocabulary

# The SentencePiece normalization a converted GGUF asks for (see the module's docstring).
NORMALIZER_KEY = "edgeinfer.tokenizer.normalizer"
REMOVE_EXTRA_WHITESPACES_KEY = "edgeinfer.tokenizer.remove_extra_whitespaces"


LLAMACPP = "llamacpp"
TOKENIZERS = "tokenizers"


class Tokenizer:
    """Text to token ids and token ids to bytes, for one GGUF vocabulary."""

    def __init__(self, path: str | Path, implementation: str | None = None) -> None:
        """``implementation``: ``"llamacpp"`` or ``"tokenizers"`` (Hugging Face's); by default llama.cpp's
        where llama-cpp-python loads, else tokenizers'."""
        if implementation not in (None, LLAMACPP, TOKENIZERS):
            raise InvalidOptionError(f"unknown tokenizer {implementation!r}; choose {LLAMACPP} or {TOKENIZERS}")
        self._lock = threading.Lock()  # held around every use of the vocabulary, and its closing
        self._vocabulary: _LlamaCppVocabulary | GGUFVocabulary | None = None
        if implementation is None:
            implementation = LLAMACPP if _llamacpp_loads() else TOKENIZERS
        self.implementation: str = implementation
        """Which library tokenizes: ``"llamacpp"`` or ``"tokenizers"``."""
        if implementation == TOKENIZERS:
            self._vocabulary = _rebuilt_vocabulary(path)
        else:
            self._vocabulary = _LlamaCppVocabulary(path)
        vocabulary = self._vocabulary
        self.n_vocab: int = vocabulary.n_vocab
        self.bos_id: int = vocabulary.bos_id
        self.eos_id: int = vocabulary.eos_id
        self.add_bos: bool = vocabulary.add_bos
        self._add_eos = vocabulary.add_eos
        self._pieces: dict[int, bytes] = {}
        self._ends: dict[int, bool] = {}
        self._normalize = _sentencepiece_normalizer(
            vocabulary.meta(NORMALIZER_KEY), vocabulary.meta(REMOVE_EXTRA_WHITESPACES_KEY) == "true", path
        )

    def encode(
        self,
        text: str,
        *,
        add_special: bool = True,
        parse_special: bool = True,
        literal: Sequence[tuple[int, int]] = (),
    ) -> list[int]:
        """Token ids for ``text``. ``add_special`` adds BOS if the model wants it;
        ``parse_special`` turns markers such as ``<|im_start|>`` into their single tokens,
        except inside the ``literal`` character spans (a chat's message contents), where a
        marker someone typed stays text and cannot forge a turn."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidOptionError(
                f"the text is not valid Unicode (an undecodable byte at position {exc.start}); pass UTF-8 text"
            ) from None
        with self._open():
            if not parse_special or not literal:
                return self._tokenize(text, add_special, parse_special)
            # Pieces tokenized one by one: BOS and EOS go at the ends of the whole, not of the first piece.
            tokens = [self.bos_id] if add_special and self.add_bos else []
            for piece, special in self._split_forged(text, literal):
                tokens += self._tokenize(piece, False, special)
            return tokens + ([self.eos_id] if add_special and self._add_eos else [])

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        if self._normalize is not None:
            text = self._normalized(text, self._normalize, parse_special)
        return self._opened.tokenize(text, add_special, parse_special)

    def _normalized(self, text: str, normalize: Callable[[str], str], parse_special: bool) -> str:
        """``text`` as the model's SentencePiece normalizer leaves it. Parsing special tokens, each
        stretch between two is normalized on its own, as transformers does, so folding whitespace
        never eats into a marker or joins the text on either side of one."""
        if not parse_special:
            return normalize(text)
        pieces, done = [], 0
        for found in self._markers.finditer(text):
            pieces += [normalize(text[done : found.start()]), found.group()]
            done = found.end()
        return "".join(pieces) + normalize(text[done:])

    def _split_forged(self, text: str, literal: Sequence[tuple[int, int]]) -> Iterator[tuple[str, bool]]:
        """``text`` in pieces, each with whether to parse markers in it; a marker that reaches into a
        literal span (also one spelled across two, or finished by the text beside one) is its own piece.

        A piece boundary can change how the text beside it tokenizes, so only forged markers get one.
        """
        done = 0
        for found in self._markers.finditer(text):
            if not any(start < found.end() and found.start() < end for start, end in literal):
                continue  # the template's own markup
            if found.start() > done:
                yield text[done : found.start()], True
            yield found.group(), False
            done = found.end()
        yield text[done:], True

    def has_markers(self, text: str) -> bool:
        """Whether ``text`` holds a control token's text, such as ``<|im_end|>``."""
        with self._open():
            return self._has_markers(text)

    def _has_markers(self, text: str) -> bool:
        return self._tokenize(text, False, True) != self._tokenize(text, False, False)

    @cached_property
    def _markers(self) -> re.Pattern[str]:
        """Every control and unknown token's text: what the tokenizer turns into one token when parsing specials."""
        vocabulary = self._opened
        texts = {
            vocabulary.render(token, special=True).decode("utf-8", "replace")
            for token in range(self.n_vocab)
            if vocabulary.is_marker(token)
        }
        longest_first = sorted((t for t in texts if t), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")

    def piece(self, token: int) -> bytes:
        """The bytes a generated token stands for; control tokens (EOS, ...) render as nothing."""
        cached = self._pieces.get(token)
        if cached is None:
            with self._open():
                cached = self._pieces[token] = self._opened.render(token, special=False)
        elif self._vocabulary is None:
            raise _closed()
        return cached

    def token_text(self, token: int) -> str:
        """A token's text including control tokens, e.g. ``<|im_end|>`` (for chat templates).

        Empty for -1, the id llama.cpp gives a token the model does not have (often BOS).
        """
        if not 0 <= token < self.n_vocab:
            return ""
        with self._open():
            return self._opened.render(token, special=True).decode("utf-8", "replace")

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    @cached_property
    def end_ids(self) -> frozenset[int]:
        """Every token that ends a generation (``is_end_of_generation``)."""
        with self._open():
            return self._opened.end_ids

    def is_end_of_generation(self, token: int) -> bool:
        # Asked once per generated token: remembered per id, as pieces are, so the lock and the
        # native call are paid once per distinct token.
        ends = self._ends.get(token)
        if ends is None:
            with self._open():
                ends = self._ends[token] = self._opened.is_end_of_generation(token)
        elif self._vocabulary is None:
            raise _closed()
        return ends

    @contextlib.contextmanager
    def _open(self) -> Iterator[None]:
        """Hold the vocabulary open for a call; a closed tokenizer is an error."""
        with self._lock:
            if self._vocabulary is None:
                raise _closed()
            yield

    @property
    def _opened(self) -> _LlamaCppVocabulary | GGUFVocabulary:
        """The vocabulary, inside ``_open``."""
        assert self._vocabulary is not None
        return self._vocabulary

    def close(self) -> None:
        """Free the vocabulary, after any call in progress in another thread has finished."""
        with self._lock:
            if self._vocabulary is not None:
                self._vocabulary.close()
                self._vocabulary = None

    def __del__(self) -> None:
        # Not contextlib.suppress: interpreter shutdown may have set this module's globals to None already.
        try:  # noqa: SIM105
            self.close()
        except Exception:  # nothing can be reported from a finalizer
            pass


def _rebuilt_vocabulary(path: str | Path) -> GGUFVocabulary:
    try:
        from edgeinfer.vocabulary import GGUFVocabulary
    except ImportError as exc:  # neither llama-cpp-python nor tokenizers
        raise BackendUnavailableError(
            f"edgeinfer tokenizes with llama-cpp-python or, without it, Hugging Face tokenizers, and neither "
            f"loads here ({exc}); install one: pip install 'edgeinfer[llamacpp]' or 'edgeinfer[onnx]'"
        ) from None
    return GGUFVocabulary(path)


# Vocabularies tokenizers rebuilds faster than llama.cpp loads in a process that has not loaded it: byte-level
# BPE, whose merges the file lists (SmolLM2: 0.14 s, against 0.29 s). SentencePiece's merges are every split of
# every token, so rebuilding Gemma 3's took 2.3 s and 201 MiB, against 0.5 s and 41 MiB for llama.cpp's.
QUICK_TO_REBUILD = frozenset({"gpt2"})


def engine_tokenizer(info: ModelInfo, backend_loads_llamacpp: bool) -> Tokenizer:
    """The tokenizer for an engine on a backend that runs on llama.cpp or not: where it does not, tokenizers'
    for a vocabulary it rebuilds quickly, so that the process loads no llama.cpp (nor the GPU drivers it opens)
    only to tokenize; else the default."""
    if backend_loads_llamacpp or info.tokenizer_model not in QUICK_TO_REBUILD:
        return Tokenizer(info.path)
    try:
        return Tokenizer(info.path, TOKENIZERS)
    # Not installed, or a vocabulary the rebuild cannot read, whatever it raises (tokenizers raises a bare
    # Exception for a merge outside the vocabulary): llama.cpp's reads more files.
    except Exception:
        if not _llamacpp_loads():
            raise
    return Tokenizer(info.path, LLAMACPP)


def _llamacpp_loads() -> bool:
    try:
        from edgeinfer.backends.llamacpp import llama_lib

        llama_lib()
    except NATIVE_LOAD_ERRORS:
        return False
    return True


class _LlamaCppVocabulary:
    """llama.cpp's tokenizer: the GGUF loaded vocab-only. Not thread-safe: ``Tokenizer`` serializes calls."""

    def __init__(self, path: str | Path) -> None:
        # Imported here so that `import edgeinfer` works, and says what is wrong, without llama.cpp.
        try:
            from edgeinfer.backends.llamacpp import free_model, llama_lib, load_model
        except NATIVE_LOAD_ERRORS as exc:
            raise BackendUnavailableError(
                f"llama-cpp-python, which this tokenizer runs on, cannot be loaded ({exc}); "
                "install it as README.md shows"
            ) from None
        self._lib = llama_lib()
        self._free = free_model
        self._model = load_model(str(path), vocab_only=True)  # the backend's, where it loaded this file
        self._vocab = self._lib.llama_model_get_vocab(self._model)
        self.n_vocab: int = self._lib.llama_vocab_n_tokens(self._vocab)
        self.bos_id: int = self._lib.llama_vocab_bos(self._vocab)
        self.eos_id: int = self._lib.llama_vocab_eos(self._vocab)
        self.add_bos = bool(self._lib.llama_vocab_get_add_bos(self._vocab))
        self.add_eos = bool(self._lib.llama_vocab_get_add_eos(self._vocab))

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 2
        buf = (ctypes.c_int32 * capacity)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (ctypes.c_int32 * capacity)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def render(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def is_marker(self, token: int) -> bool:
        flags = self._lib.LLAMA_TOKEN_ATTR_CONTROL | self._lib.LLAMA_TOKEN_ATTR_UNKNOWN
        return bool(self._lib.llama_vocab_get_attr(self._vocab, token) & flags)

    def is_end_of_generation(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    @property
    def end_ids(self) -> frozenset[int]:
        return frozenset(token for token in range(self.n_vocab) if self.is_end_of_generation(token))

    def meta(self, key: str) -> str | None:
        """The GGUF metadata value under ``key`` as text, None if the file has no such key."""
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def close(self) -> None:
        self._free(self._model)


def _sentencepiece_normalizer(rule: str | None, fold_whitespace: bool, path: str | Path) -> Callable[[str], str] | None:
    """The text normalization a GGUF's SentencePiece model applied before tokenizing, None if none.

    Only the rule and the whitespace folding: the ▁ before the text and for each space are llama.cpp's.
    """
    if rule is None:
        return None
    import sentencepiece  # a dependency, imported only for the models that need it

    try:
        normalizer = sentencepiece.SentencePieceNormalizer(
            rule_name=rule, add_dummy_prefix=False, escape_whitespaces=False, remove_extra_whitespaces=fold_whitespace
        )
    except (RuntimeError, ValueError):  # a rule this sentencepiece does not know (NOT_FOUND, INVALID_ARGUMENT)
        raise InvalidModelError(
            f"{path} asks for text normalized with {rule!r} ({NORMALIZER_KEY}), a rule sentencepiece "
            f"{sentencepiece.__version__} does not know; run: pip install -U sentencepiece"
        ) from None
    return normalizer.normalize


def _closed() -> EdgeInferError:
    return EdgeInferError("this tokenizer is closed (its engine was closed); create a new Engine")
