"""Incremental detokenization with stop strings (pure Python, imports no JAX): the engine's
stop-string check and the server's streamed text both use it, so each step decodes only the
new tokens, not the whole output (which made a long generation O(tokens^2)).

decode(a + b) != decode(a) + decode(b) at word boundaries (a decoder may drop a leading space
of the first token it sees), so the new tokens are decoded with the previous step's tokens as
left context and the context's own text is cut off again. A trailing partial UTF-8 character
(U+FFFD) waits for its next bytes unless the sequence is final.
"""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    """The text of a growing token sequence, trimmed before the first stop string found.

    `update(token_ids, final, check_stop)` takes the whole sequence so far (append-only; a
    Snapshot serves) and decodes what is new; it returns True when a stop string matched in
    this update. With check_stop False (e.g. before min_tokens) the new text is not searched:
    a later update searches from its own new text (and the len(stop) - 1 characters before)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.text = ""
        self.stopped = False  # a stop string matched; text ends before it
        self._offsets = (0, 0)  # token ids [p, r): p the left context of the next decode, r committed

    def update(self, token_ids: Sequence[int], final: bool = False, check_stop: bool = True) -> bool:
        if self.stopped:
            return False
        (p, r), old_len = self._offsets, len(self.text)
        before, now = self._decode(token_ids[p:r]), self._decode(token_ids[p:])
        if len(now) > len(before) and (not now.endswith("\ufffd") or final):
            self.text, self._offsets = self.text + now[len(before):], (r, len(token_ids))
        # NOTE: the first stop string to end wins (of those ending at one character, the longest),
        # whatever their order and however the text splits into tokens: one character a step
        # would have stopped there. Searched only where a match could end in the new text.
        hits = [(cut + len(s), cut) for s in (self.stop if check_stop else ())
                if (cut := self.text.find(s, max(0, old_len - len(s) + 1))) >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)[1]], True
        return self.stopped

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
