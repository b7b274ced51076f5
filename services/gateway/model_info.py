"""What the gateway knows of the model: its name, context length and tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from nitsum.model.tokenizer import Tokenizer
from nitsum.wire.messages import SamplingSpec
from nitsum_services.gateway.protocol import ApiError


@dataclass
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Tokenizer

    @classmethod
    def load(cls, model_dir: Path, served_name: str = "") -> ModelInfo:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        tokenizer = Tokenizer(model_dir, config)
        return cls(
            name=served_name or Path(model_dir).name,
            max_model_len=int(config.get("max_position_embeddings", 2048)),
            vocab_size=int(config["vocab_size"]),
            tokenizer=tokenizer,
        )

    @property
    def probe_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else 0

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_bos=True)
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", "prompt")
        return ids

    def encode_chat(self, messages: list[dict]) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as exc:  # a template error is the caller's message shape, not a server fault
            raise ApiError(400, f"the chat template rejected the messages: {exc}", "messages") from None
        return self.tokenizer.encode(text)

    def token_text(self, token_id: int) -> str:
        """One token's own text (logprobs name tokens by it); special tokens too."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})", "prompt")

    def fit_max_tokens(self, sampling: SamplingSpec, prompt_len: int, fill_context: bool) -> SamplingSpec:
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise ApiError(
                400,
                f"the prompt has {prompt_len} tokens; this model's context is {self.max_model_len} tokens",
                "messages" if fill_context else "prompt",
                "context_length_exceeded",
            )
        if fill_context:
            return replace(sampling, max_tokens=room)
        if sampling.max_tokens > room:
            raise ApiError(
                400,
                f"max_tokens={sampling.max_tokens} plus the prompt's {prompt_len} tokens exceeds the context of {self.max_model_len} tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        return sampling
