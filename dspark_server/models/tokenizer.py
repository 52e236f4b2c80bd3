"""``tokenizer.json`` + chat template, and an incremental detokenizer that emits valid UTF-8 only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

# Texts at least this long are encoded on the GIL-releasing batch path.
RELEASE_GIL_CHARS = 2048


def _raise(message: str) -> None:
    raise TemplateError(message)


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = root / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        self.eos_token: str | None = _token_str(cfg.get("eos_token"))
        self.bos_token: str | None = _token_str(cfg.get("bos_token"))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(self.chat_template) if self.chat_template else None
        self._max_token_chars: int | None = None
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        if len(text) < RELEASE_GIL_CHARS:
            return self._tok.encode(text, add_special_tokens=False).ids
        # ``encode`` holds the GIL for the whole text (seconds for megabytes, stalling every other
        # thread); ``encode_batch`` runs it in Rust with the GIL released.
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    @property
    def max_token_chars(self) -> int:
        """An upper bound on the input characters one token can stand for: the longest vocabulary
        entry (bytes for byte-level BPE, so at least its characters), times 4 for a normalizer
        such as NFC that composes up to 4 input code points into one. A text longer than
        ``n * max_token_chars`` characters has more than ``n`` tokens."""
        if self._max_token_chars is None:
            longest = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
            self._max_token_chars = 4 * max(1, longest)
        return self._max_token_chars

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            # No template: plain "role: content" lines, so base models still answer something.
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete characters.

    A byte-level BPE token can end in the middle of a multi-byte character; decoding such a prefix
    yields U+FFFD. Text is emitted only once the decoded tail no longer ends with it.
    """

    # Re-decoding a few tokens before the unread part keeps merges at the boundary correct.
    CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT :]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self.prefix_offset = max(0, len(self.ids) - self.CONTEXT)
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. a truncated character at the end of the output)."""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :]
