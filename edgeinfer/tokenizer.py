"""The tokenizer: llama.cpp's own, loaded vocab-only from the GGUF, shared by every backend.

Using llama.cpp's tokenizer everywhere means every backend sees exactly the
token ids llama.cpp would, pre-tokenizer quirks included.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

from edgeinfer.backends import LOAD_ERRORS
from edgeinfer.errors import BackendUnavailableError, EdgeInferError, InvalidOptionError


class Tokenizer:
    """Text to token ids and token ids to bytes, for one GGUF vocabulary."""

    def __init__(self, path: str | Path) -> None:
        # Imported here so that `import edgeinfer` works, and says what is wrong, without llama.cpp.
        try:
            from edgeinfer.backends.llamacpp import llama_lib, load_model
        except LOAD_ERRORS as exc:
            raise BackendUnavailableError(
                f"llama-cpp-python, which edgeinfer tokenizes with, cannot be loaded ({exc}); "
                "install it as README.md shows"
            ) from None
        self._model = None
        self._lib = llama_lib()
        self._model = load_model(str(path), vocab_only=True)
        self._vocab = self._lib.llama_model_get_vocab(self._model)
        self.n_vocab: int = self._lib.llama_vocab_n_tokens(self._vocab)
        self.bos_id: int = self._lib.llama_vocab_bos(self._vocab)
        self.eos_id: int = self._lib.llama_vocab_eos(self._vocab)
        self.add_bos: bool = bool(self._lib.llama_vocab_get_add_bos(self._vocab))
        self._pieces: dict[int, bytes] = {}

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for ``text``. ``add_special`` adds BOS if the model wants it;
        ``parse_special`` turns markers such as ``<|im_start|>`` into their single tokens."""
        self._check_open()
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidOptionError(
                f"the text is not valid Unicode (an undecodable byte at position {exc.start}); pass UTF-8 text"
            ) from None
        capacity = len(data) + 2
        buf = (ctypes.c_int32 * capacity)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (ctypes.c_int32 * capacity)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes a generated token stands for; control tokens (EOS, ...) render as nothing."""
        cached = self._pieces.get(token)
        if cached is None:
            cached = self._pieces[token] = self._render(token, special=False)
        return cached

    def token_text(self, token: int) -> str:
        """A token's text including control tokens, e.g. ``<|im_end|>`` (for chat templates).

        Empty for -1, the id llama.cpp gives a token the model does not have (often BOS).
        """
        if not 0 <= token < self.n_vocab:
            return ""
        return self._render(token, special=True).decode("utf-8", "replace")

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def is_end_of_generation(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    def _check_open(self) -> None:
        if self._model is None:
            raise EdgeInferError("this tokenizer is closed (its engine was closed); create a new Engine")

    def _render(self, token: int, *, special: bool) -> bytes:
        self._check_open()
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def close(self) -> None:
        if self._model:
            self._lib.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn the module down already
            self.close()
