"""One choice of an OpenAI completions / chat response, as the server builds it (no FastAPI).

`Choice` follows one engine request's outputs: its text detokenized and trimmed at a stop
string, OpenAI's `logprobs` of its tokens (each named by its text, decoded alone, as vLLM's, or
`token_id:ID` with vLLM's return_tokens_as_token_ids; completions' `top_logprobs` hold the
token itself too; `text_offset`: where each token's text begins in the choice's text), and
(echo) the scored prompt put before them, as the request gave it.
`prompt_logprobs` formats one scored prompt (a `loopjax.scoring.ScoreOutput`) as vLLM's field:
`None` for the first token, then per prompt token a dict {token id as a string (a JSON key):
{"logprob", "rank", "decoded_token"}} holding the prompt token and the k most likely tokens
(ranks 1..k); the prompt token's rank is its place among them when listed there, else its rank
over the vocabulary (`listed_rank`: vLLM's, whose top entries overwrite the token's own).
Tokens are named by the model's tokenizer (`tokenizers.Tokenizer`) or, without one, by their
ids (decoded_token null, as vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence

from loopjax.detokenizer import IncrementalDetokenizer
from loopjax.sampling_params import listed_rank

MIN_LOGPROB = -9999.0  # vLLM's floor for a log-probability in a response: JSON has no -inf
# vLLM's response fields of what loopjax never returns, with the values vLLM's protocol models give them
# (null; no tool call), for clients that read them. Full responses only: vLLM's stream chunks leave
# out the fields they do not set. The response's top (both endpoints), and its usage:
NULL_RESPONSE_FIELDS = {"service_tier": None, "system_fingerprint": None, "kv_transfer_params": None}
NULL_USAGE_FIELDS = {"prompt_tokens_details": None}
# a chat choice's message (no tool or reasoning parser: `reasoning_content` is older vLLM's name)
NULL_MESSAGE_FIELDS = {"refusal": None, "annotations": None, "audio": None, "function_call": None,
                       "tool_calls": [], "reasoning": None, "reasoning_content": None}
# what the request did not ask: a completions choice's prompt_logprobs and prompt_token_ids
# (return_token_ids'), a chat response's at its top
NULL_PROMPT_FIELDS = {"prompt_logprobs": None, "prompt_token_ids": None}


def with_null_fields(response: dict, chat: bool) -> dict:
    """A full (not streamed) response with vLLM's null fields where it has none (the ones above)."""
    nulls = NULL_RESPONSE_FIELDS | (NULL_PROMPT_FIELDS if chat else {})
    return nulls | response | {"usage": response["usage"] | NULL_USAGE_FIELDS}


def _floored(logprob):
    """A log-probability as a response holds it: -inf (and NaN) as MIN_LOGPROB, as vLLM's (-inf
    made the full answer a 500: JSON cannot hold it; a stream sent -Infinity, no JSON); None kept."""
    return logprob if logprob is None or logprob >= MIN_LOGPROB else MIN_LOGPROB


def prompt_logprobs(scored, k: int, tokenizer) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of one scored prompt, with the top `k` (<= scored's) per token."""
    names: dict[int, str | None] = {}  # each token decoded once per prompt

    def entry(token: int, logprob: float, rank: int) -> dict:
        if token not in names:  # NOTE: vLLM decodes each token alone, special tokens kept
            names[token] = None if tokenizer is None else tokenizer.decode([token], skip_special_tokens=False)
        return {"logprob": _floored(logprob), "rank": rank, "decoded_token": names[token]}

    out: list[dict | None] = [None]
    for token, lp, rank, top in zip(scored.token_ids[1:], scored.token_logprobs, scored.ranks,
                                    scored.top_logprobs, strict=True):
        position = {str(token): entry(token, lp, listed_rank(token, rank, top[:k]))}
        for r, (u, v) in enumerate(top[:k], 1):
            if u != token:
                position[str(u)] = entry(u, v, r)
        out.append(position)
    return out


def stop_prefix_len(text: str, stop) -> int:
    """How many characters at the end of `text` may still begin a stop string (held back from
    the stream): the longest end of it that is a proper prefix of one of them."""
    return max((k for s in stop for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
               default=0)


def usage_of(choices: list, prompts: list[list[int]], n: int) -> dict:
    """OpenAI's usage of `choices` (choice i samples prompt i // n), each prompt counted once,
    plus loopjax's device `submissions`; of one choice: vLLM's continuous_usage_stats."""
    given = sum(len(prompts[p]) for p in {c.index // n for c in choices})
    gen = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": given, "completion_tokens": gen, "total_tokens": given + gen,
            "submissions": sum(c.submissions for c in choices)}


def _top_entries(name, token: int, logprob: float, top) -> dict[str, float]:
    """Completions' top_logprobs at one position: the top (id, log p) pairs by name, most likely
    first, and the position's own token after them when it is not among them (OpenAI's "up to
    logprobs + 1 elements": the sampled token's log p is always there; vLLM's too, and its
    echoed prompt tokens')."""
    entries = {name(u): _floored(v) for u, v in top}
    entries.setdefault(name(token), _floored(logprob))
    return entries


class Choice:
    """One choice as outputs arrive: text detokenized and trimmed at a stop string."""

    def __init__(self, index: int, tokenizer, params, *, prompt: Sequence[int] = (),
                 ids_as_names: bool = False):
        """params: the request's SamplingParams (its stop strings and text fields); prompt: its
        token ids (the text is decoded after their tail, as vLLM's);
        ids_as_names: logprobs name tokens "token_id:ID" (vLLM's return_tokens_as_token_ids)."""
        self.index, self.tokenizer, self.stop = index, tokenizer, params.stop
        self.ids_as_names = ids_as_names
        self.include_stop = params.include_stop_str_in_output
        self.text, self.sent, self.submissions = "", 0, 0  # full text; characters streamed; total
        self.detokenizer = (None if tokenizer is None
                            else IncrementalDetokenizer.for_output(tokenizer, params, prompt))
        self.stop_reason = None  # vLLM's: the stop string or stop id that ended it (None: tokenizer's EOS)
        self.token_ids, self.exit_loops = [], []  # generated tokens; loops run per token
        self.finish_reason = None
        self.logprobs = self.top_logprobs = None if params.logprobs is None else []  # when asked
        self._names: dict[int, str] = {}  # token id -> its text in logprobs
        self._echoed = 0  # characters of the echoed prompt before the completion's text

    def opening(self, chat: bool, delta: dict) -> dict:
        """A streamed chunk of this choice of no tokens: chat's `delta` (its role, or echo's text),
        logprobs null (vLLM's); completions' empty text and logprobs, which echo fills with the
        prompt's."""
        first = {"index": self.index, "finish_reason": self.finish_reason, "token_ids": [], "exit_loops": []}
        return first | ({"delta": delta, "logprobs": None} if chat
                        else {"text": "", "logprobs": self._logprobs(0, False)})

    def update(self, out) -> tuple[str, int]:
        """Apply one RequestOutput; returns (text delta, number of new tokens)."""
        # NOTE: the outputs' cumulative fields are Snapshots: kept, not copied, every step
        self.token_ids, self.exit_loops = out.token_ids, out.exit_loops
        self.logprobs, self.top_logprobs = out.logprobs, out.top_logprobs
        self.submissions = out.metrics.get("num_submissions") or 0  # the request's so far; usage's sum
        if self.detokenizer is not None:
            # NOTE: the engine's "stop" is a stop token's (EOS, a stop id): it adds no text
            # NOTE: an aborted output's text ends at its last whole character (detokenizer.py)
            if self.detokenizer.update(self.token_ids, final=out.finished and out.finish_reason != "abort",
                                       stop_token=out.finished and out.finish_reason == "stop"
                                       and not self.include_stop):
                self.finish_reason, self.stop_reason = "stop", self.detokenizer.stop_string
            self.text = self.detokenizer.text
        if out.finished and self.finish_reason is None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        end = len(self.text) - (0 if self.finish_reason else stop_prefix_len(self.text, self.stop))
        delta, self.sent = self.text[self.sent:max(end, self.sent)], max(end, self.sent)
        return delta, len(out.new_token_ids)

    def fields(self, start: int, chat: bool) -> dict:
        """finish_reason, OpenAI logprobs and loopjax's extras of the tokens from `start` on."""
        ids = self.token_ids[start:]
        return {"index": self.index, "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
                "logprobs": self._logprobs(start, chat), "token_ids": ids,
                "exit_loops": self.exit_loops[start:]}

    def answer(self, chat: bool, role: str | None, echoed: str) -> dict:
        """This choice in a full response, with vLLM's fields of nothing asked: a chat message's
        NULL_MESSAGE_FIELDS, completions' NULL_PROMPT_FIELDS (the server sets them when asked);
        `echoed`: chat's text before the answer's."""
        if chat:
            return self.fields(0, True) | {"message": {"role": role, "content": echoed + self.text,
                                                       **NULL_MESSAGE_FIELDS}}
        return self.fields(0, False) | {"text": self.text, **NULL_PROMPT_FIELDS}

    def echo(self, choice: dict, scored, num_top: int, echoed: tuple[str, list[int] | None] | None) -> None:
        """Put the prompt (a ScoreOutput) before this choice's completion text and logprobs
        (the top `num_top` of each prompt token: the request's `logprobs`); `echoed`: the
        prompt's text and its tokens' offsets in it (`RequestParser.echo_prompts`), None
        without a tokenizer. The completion's text offsets, these and later ones, follow it."""
        prompt = scored.token_ids
        if echoed is not None:
            choice["text"] = echoed[0] + choice["text"]
            self._echoed = len(echoed[0])
        if choice["logprobs"] is not None:
            name = self._token_name()
            lp = choice["logprobs"]
            lp["tokens"] = [name(t) for t in prompt] + lp["tokens"]
            lp["token_logprobs"] = [None, *map(_floored, scored.token_logprobs), *lp["token_logprobs"]]
            tops = (_top_entries(name, t, v, top[:num_top])
                    for t, v, top in zip(prompt[1:], scored.token_logprobs, scored.top_logprobs, strict=True))
            lp["top_logprobs"] = [None, *tops, *lp["top_logprobs"]]
            if echoed is not None:
                lp["text_offset"] = echoed[1] + [o + self._echoed for o in lp["text_offset"]]

    def _token_name(self):
        """A token's name in logprobs: its text, decoded alone with special tokens kept (vLLM's
        and prompt_logprobs' decoded_token; not the vocabulary string, "Ġh" for " h" under a
        byte-level BPE), each decoded once per choice; its id without a tokenizer; "token_id:ID"
        when asked (vLLM's return_tokens_as_token_ids: a text no JSON can garble)."""
        tok, names = self.tokenizer, self._names
        if self.ids_as_names:
            return "token_id:{}".format
        if tok is None:
            return str

        def name(t: int) -> str:
            if t not in names:
                names[t] = tok.decode([t], skip_special_tokens=False)
            return names[t]
        return name

    def _logprobs(self, start: int, chat: bool):
        if self.logprobs is None:
            return None
        name = self._token_name()
        ids, lps = self.token_ids[start:], [_floored(lp) for lp in self.logprobs[start:]]
        tops = (self.top_logprobs or [[]] * len(self.token_ids))[start:]
        if chat:
            def entry(t, lp):
                return {"token": name(t), "logprob": _floored(lp), "bytes": list(name(t).encode())}
            return {"content": [entry(t, lp) | {"top_logprobs": [entry(u, v) for u, v in top]}
                                for t, lp, top in zip(ids, lps, tops)]}
        return {"tokens": [name(t) for t in ids], "token_logprobs": lps,
                "top_logprobs": [_top_entries(name, t, lp, top) for t, lp, top in zip(ids, lps, tops)],
                "text_offset": self._text_offsets(start, len(ids))}

    def _text_offsets(self, start: int, count: int) -> list[int] | None:
        """Where tokens start.. start + count begin in the choice's text (echo included): the
        detokenizer's offsets, cut to the text's end (a stop string trims it); each token's
        true place, where vLLM sums the lengths of the tokens' names (a skipped special token,
        a character split over tokens make them differ). None without a tokenizer."""
        if self.detokenizer is None:
            return None
        offsets, end = self.detokenizer.offsets, len(self.text)
        return [self._echoed + min(offsets[i] if i < len(offsets) else end, end)
                for i in range(start, start + count)]
