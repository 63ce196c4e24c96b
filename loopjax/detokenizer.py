"""Incremental detokenization with stop strings (pure Python, imports no JAX): the engine's
stop-string check and the server's streamed text (and its text offsets) both use it, so each
step decodes only the new tokens, not the whole output (which made a long generation
O(tokens^2)).

decode(a + b) != decode(a) + decode(b) at word boundaries (a decoder may drop a leading space
of the first token it sees), so the new tokens are decoded with the previous step's tokens as
left context and the context's own text is cut off again; the first ones get the prompt's
tail (`prompt_context`, vLLM's rule) as theirs, so a SentencePiece word marker of the first
token is the space it stands for after a prompt, as in vLLM (a decoder drops it at the start of
a text). A trailing partial UTF-8 character (U+FFFD) waits for its next bytes unless the
sequence is final (finished other than by an abort: an aborted request's text ends at its last
whole character, as vLLM's, whose text is what it streamed).
"""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    """The text of a growing token sequence, trimmed before the first stop string found.

    `update(token_ids, final)` takes the whole sequence so far (append-only; a
    Snapshot serves) and decodes what is new, one token at a time; it returns True when a stop
    string matched in this update. `offsets[i]` is where token i's text starts in `text`
    (completions' text_offset): the text's length before it, so a skipped special token or the
    first bytes of a character split over tokens add nothing; past a stop string's cut it may
    exceed len(text). Special tokens are left out unless skip_special_tokens is False;
    spaces_between_special_tokens False (with skip_special_tokens False, as vLLM's) joins
    consecutive added tokens without spaces.
    A stop string must end past the text of the first `min_tokens` tokens (vLLM's rule): as an
    EOS may be token min_tokens + 1 at the earliest, so may the token that completes a stop
    string.
    `stop_token` (with final): the last token ended the sequence (an EOS or stop id); it adds no
    text, as in vLLM, special or not (the caller passes False under include_stop_str_in_output).
    A matched stop string is `stop_string`; the text ends before it, or after it with
    include_stop_str (vLLM's include_stop_str_in_output)."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, include_stop_str: bool = False,
                 min_tokens: int = 0, context: Sequence[int] = ()):
        """context: token ids before the sequence (`prompt_context` of its prompt), the left
        context of its first tokens; none for a text of its own (an echoed prompt)."""
        self.tokenizer, self.stop, self.skip_special_tokens = tokenizer, tuple(stop), skip_special_tokens
        self.context = list(context)
        self.min_tokens = min_tokens
        # NOTE: spaces_between_special_tokens False: an added token right after another is its
        # content alone, without the space a decoder may put between tokens (vLLM's fast rule,
        # which skip_special_tokens turns off: the token before may be a skipped one)
        self._added = None if spaces_between_special_tokens or skip_special_tokens else {
            t: a.content for t, a in tokenizer.get_added_tokens_decoder().items()}
        self.include_stop_str = include_stop_str
        self.text = ""
        self.stopped = False  # a stop string matched; text ends before it (or after it)
        self.stop_string: str | None = None  # the stop string that matched
        self.offsets: list[int] = []
        self._window = (0, 0)  # token ids [p, r): p the left context of the next decode, r committed

    @classmethod
    def for_output(cls, tokenizer, params, prompt_ids: Sequence[int]) -> IncrementalDetokenizer:
        """The detokenizer of one output of a request: its SamplingParams' text fields, the
        prompt's tail as the first tokens' context."""
        return cls(tokenizer, params.stop, params.skip_special_tokens, params.spaces_between_special_tokens,
                   params.include_stop_str_in_output, params.min_tokens,
                   context=prompt_context(tokenizer, prompt_ids))

    def update(self, token_ids: Sequence[int], final: bool = False, stop_token: bool = False) -> bool:
        if self.stopped:
            return False
        old_len, end = len(self.text), len(token_ids) - stop_token
        # NOTE: one token at a time (each is usually alone: one step's), so that each has its offset
        for n in range(len(self.offsets) + 1, end + 1):
            self.offsets.append(len(self.text))
            self._commit(token_ids, n, final and n == end)
        if final and self._window[1] < end:  # no new token, but a character waits
            self._commit(token_ids, end, True)
        self.offsets += [len(self.text)] * (len(token_ids) - len(self.offsets))  # the stop token
        # NOTE: the first stop string to end wins (of those ending at one character, the longest),
        # whatever their order and however the text splits into tokens: one character a step
        # would have stopped there. Searched only where a match could end in the new text, past
        # the first min_tokens tokens' text (its end: where the next token's text starts).
        floor = self.offsets[self.min_tokens] if len(self.offsets) > self.min_tokens else len(self.text)
        start = max(old_len, floor)
        hits = [(cut + len(s), cut, s) for s in self.stop
                if (cut := self.text.find(s, max(0, start - len(s) + 1))) >= 0]
        if hits:
            end, cut, self.stop_string = min(hits)
            self.text, self.stopped = self.text[:end if self.include_stop_str else cut], True
        return self.stopped

    def _commit(self, token_ids: Sequence[int], n: int, final: bool) -> None:
        """Add the text of token_ids[r:n] (decoded after their left context [p, r), which the
        prompt's context precedes until p moves)."""
        p, r = self._window
        head = self.context if p == 0 else []
        before, now = self._decode([*head, *token_ids[p:r]]), self._decode([*head, *token_ids[p:n]])
        if r == 0:
            before = _whole(before)
        if len(now) > len(before) and (not now.endswith("\ufffd") or final):
            added, piece = self._added, now[len(before):]
            if added and n >= 2 and token_ids[n - 1] in added and token_ids[n - 2] in added:
                piece = added[token_ids[n - 1]]
            self.text, self._window = self.text + piece, (r, n)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


def _whole(context_text: str) -> str:
    """The context's text without a character its last tokens leave unfinished: the output's
    first tokens bring its other bytes, and it is their text (vLLM's detokenizer, primed with
    the prompt, holds it back and emits it with them)."""
    return context_text.rstrip("\ufffd")


def prompt_context(tokenizer, prompt_ids: Sequence[int]) -> list[int]:
    """The prompt's tail that precedes the output's first tokens when they are decoded (vLLM's
    rule): its shortest suffix of 4 to 23 tokens whose text has no U+FFFD (no character cut at
    its start), else the whole prompt."""
    prompt_ids = list(prompt_ids)
    for size in range(4, min(len(prompt_ids), 23) + 1) if len(prompt_ids) > 4 else ():
        if "\ufffd" not in tokenizer.decode(prompt_ids[-size:]):
            return prompt_ids[-size:]
    return prompt_ids


def decode_output(tokenizer, token_ids: Sequence[int], context: Sequence[int] = (),
                  skip_special_tokens: bool = True, complete: bool = True) -> str:
    """The text of a whole output at once, as `IncrementalDetokenizer` makes it token by token
    (without stop strings): decoded after `context`; not `complete` (aborted), cut after its
    last whole character, as the incremental text waits for a character's next bytes."""
    def text_of(ids: Sequence[int]) -> str:
        ids = [*context, *ids]
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if ids else ""

    start, end = len(_whole(text_of([]))), len(token_ids)
    text = text_of(token_ids)
    while not complete and end and text.endswith("\ufffd"):  # a partial character: its tokens wait
        end -= 1
        text = text_of(token_ids[:end])
    return text[start:] if len(text) > start else ""
