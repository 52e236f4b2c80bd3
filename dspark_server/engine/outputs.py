"""Appending sampled tokens to a request: detokenization, stop conditions, stream deltas."""

from __future__ import annotations

from dataclasses import replace

from dspark_server.engine.request import Request, RequestOutput
from dspark_server.models.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def append(self, req: Request, tokens: list[int]) -> int:
        """Append tokens in order until a stop condition; returns how many were kept.

        Tokens after a stop (e.g. the rest of an accepted speculative block) are dropped, so the
        output ends exactly where plain decoding would have stopped.
        """
        detok = self._detok.get(req.request_id)
        if detok is None:
            detok = self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_ids)
        p = req.params
        if not p.stop:
            return self._append_ids(req, tokens, detok)
        kept = 0
        stopped_by_string = False
        for tok in tokens:
            req.output_ids.append(tok)
            kept += 1
            text_before = len(req.output_text)
            req.output_text += detok.push([tok])
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                req.finish_reason = "stop"
            elif p.stop and self._truncate_at_stop(req, text_before):
                req.finish_reason = "stop"
                stopped_by_string = True
            elif len(req.output_ids) >= p.max_tokens:
                req.finish_reason = "length"
            if req.finish_reason is not None:
                break
        if req.finish_reason is not None and not stopped_by_string:
            req.output_text += detok.flush()
        return kept

    def _append_ids(self, req: Request, tokens: list[int], detok: IncrementalDetokenizer) -> int:
        """``append`` for a request without stop strings: its stop conditions read token ids only,
        so the tokens it keeps are known first and detokenized in one call (a speculative round
        emits several; each detokenizer call decodes twice)."""
        p = req.params
        room = p.max_tokens - len(req.output_ids)
        kept = 0
        for tok in tokens:
            kept += 1
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                req.finish_reason = "stop"
                break
            if kept >= room:
                req.finish_reason = "length"
                break
        new = tokens[:kept] if kept < len(tokens) else tokens
        req.output_ids.extend(new)
        req.output_text += detok.push(new)
        if req.finish_reason is not None:
            req.output_text += detok.flush()
        return kept

    def finish(self, req: Request, reason: str) -> None:
        """End ``req`` for a reason found outside ``append`` (e.g. an EOS id only an external
        engine's config lists): the held-back text of its detokenizer is flushed."""
        req.finish_reason = reason
        detok = self._detok.get(req.request_id)
        if detok is not None:
            req.output_text += detok.flush()

    @staticmethod
    def _truncate_at_stop(req: Request, text_before: int) -> bool:
        longest = max(len(s) for s in req.params.stop)
        search_from = max(0, text_before - longest + 1)
        hits = [i for s in req.params.stop if (i := req.output_text.find(s, search_from)) >= 0]
        if not hits:
            return False
        req.output_text = req.output_text[: min(hits)]
        return True

    def delta(self, req: Request, finished: bool, error: str | None = None) -> RequestOutput:
        """The part of the output not yet sent; a possible stop-string prefix is held back."""
        visible = len(req.output_text)
        if not finished and req.params.stop:
            visible = max(req.sent_text_len, visible - (max(len(s) for s in req.params.stop) - 1))
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=tuple(req.output_ids[req.sent_token_len :]),
            new_text=req.output_text[req.sent_text_len : visible],
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            spec=replace(req.spec),
            error=error,
            cached_tokens=req.cached_tokens or 0,
        )
        req.sent_text_len = visible
        req.sent_token_len = len(req.output_ids)
        if finished:
            self._detok.pop(req.request_id, None)
        return out
