"""One choice's text as its tokens arrive: the pieces safe to stream, and the final text exactly as the
in-process LM makes it (all tokens decoded at once, special tokens skipped, cut at the first stop string).

Streaming decodes incrementally (a short window of tokens, as vLLM's detokenizer does, not the whole text
again per token) and holds back what could still change: an incomplete UTF-8 character, and the last
`len(longest stop) - 1` characters, which may be the start of a stop string. When the choice ends, the rest
of the final text is sent, so the pieces of a stream add up to the non-streamed text.
"""

from __future__ import annotations

from evalkit.serve.backend import End, Token


class Text:
    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[Token] = []
        self.hold = max((len(s) for s in stops), default=1) - 1
        self._prefix = self._read = 0  # token offsets of the incremental decode window
        self._text = ""  # decoded so far, incrementally
        self.sent = 0  # characters of the text already handed out
        self.end: End | None = None

    @property
    def ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    def add(self, event: Token | End) -> str:
        """The next piece of text safe to send (often empty), after this token or the end."""
        if isinstance(event, End):
            self.end = event
            return self._take(self.final())
        self.tokens.append(event)
        ids = self.ids
        before = self._decode(ids[self._prefix : self._read])
        after = self._decode(ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):  # a whole new character at least
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(ids)
        at = self._stop_at(self._text)
        return self._take(self._text[:at] if at is not None else self._text[: len(self._text) - self.hold])

    def final(self) -> str:
        """The whole text as the in-process LM decodes it (evalkit.request.finish_text's cut)."""
        text = self._decode(self.ids)
        at = self._stop_at(text)
        return text if at is None else text[:at]

    def _take(self, safe: str) -> str:
        piece = safe[self.sent :]
        self.sent += len(piece)
        return piece

    def _stop_at(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # --- logprobs in OpenAI's two formats -----------------------------------------------------------------
    def piece_of(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def completion_logprobs(text: Text, tokens: list[Token], offset: int) -> dict:
    """/v1/completions' `logprobs`: tokens, their logprobs, their alternatives, their text offsets."""
    pieces = [text.piece_of(t.id) for t in tokens]
    offsets, at = [], offset
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {
        "tokens": pieces,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{text.piece_of(i): lp for i, lp in t.top} for t in tokens],
        "text_offset": offsets,
    }


def chat_logprobs(text: Text, tokens: list[Token]) -> dict:
    """/v1/chat/completions' `logprobs`: one entry per token with its alternatives."""

    def entry(token_id: int, logprob: float) -> dict:
        piece = text.piece_of(token_id)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    return {
        "content": [
            {**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in tokens
        ]
    }
