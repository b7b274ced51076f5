"""Tokenizer of a Hugging Face model directory: tokenizer.json (the `tokenizers` library) plus
tokenizer_config.json (special tokens, chat template rendered with jinja2), and incremental detokenization.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    """A tokenizer file is missing or unusable (the message names it)."""


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path, model_config: dict | None = None) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        directory = Path(model_dir)
        tokenizer_path = directory / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise TokenizerError(f"missing tokenizer file: {tokenizer_path}")
        self._tok = HFTokenizer.from_file(str(tokenizer_path))
        config_path = directory / "tokenizer_config.json"
        tok_config: dict = json.loads(config_path.read_text()) if config_path.is_file() else {}
        model_config = model_config or {}

        self.chat_template: str | None = tok_config.get("chat_template")
        if isinstance(self.chat_template, list):  # some configs hold named templates
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()))
        self.bos_token = _token_content(tok_config.get("bos_token"))
        self.eos_token = _token_content(tok_config.get("eos_token"))
        self.add_bos_token = bool(tok_config.get("add_bos_token", False))
        self.bos_token_id: int | None = self._id_of(self.bos_token, model_config.get("bos_token_id"))
        eos_from_config = model_config.get("eos_token_id")
        if isinstance(eos_from_config, list):
            eos_from_config = eos_from_config[0] if eos_from_config else None
        eos_id = self._id_of(self.eos_token, eos_from_config)
        if eos_id is None:
            raise TokenizerError(f"no eos token in {config_path} or config.json")
        self.eos_token_id: int = eos_id
        if self.eos_token is None:
            self.eos_token = self._tok.id_to_token(eos_id)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = frozenset(int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def _id_of(self, token: str | None, fallback: Any) -> int | None:
        if token is not None:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return int(token_id)
        return int(fallback) if isinstance(fallback, int) else None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.chat_template:
            raise TokenizerError("this model's tokenizer_config.json has no chat_template")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        template = env.from_string(self.chat_template)
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.UndefinedError as exc:
            raise TokenizerError(f"chat template: {exc}") from exc


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Decodes a short window (`prefix_offset`..end) and emits only what extends the already-emitted
    window text; if the newest bytes end mid-character (U+FFFD at the end) it waits for more tokens.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        # The library's decode itself (skip_special_tokens defaults to True, as in `Tokenizer.decode`):
        # this runs for every generated token, and the wrapper's extra call and list copy showed up
        # in the engine's per-step profile.
        self._decode = tokenizer._tok.decode
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_id: int) -> str:
        ids = self.token_ids
        ids.append(token_id)
        prefix, read = self._prefix_offset, self._read_offset
        prefix_text = self._decode(ids[prefix:read]) if read > prefix else ""
        full_text = self._decode(ids[prefix:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix_offset = read
            self._read_offset = len(ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self._tokenizer.decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._tokenizer.decode(self.token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

    def export(self) -> list:
        """[token ids, prefix offset, read offset]: what `restore` takes (a request moving to another engine)."""
        return [list(self.token_ids), self._prefix_offset, self._read_offset]

    def restore(self, state: list) -> None:
        self.token_ids, self._prefix_offset, self._read_offset = list(state[0]), int(state[1]), int(state[2])
