"""The prompts' part of an OpenAI response: completions' `echo` (each prompt's text, tokens and
log-probabilities before its choices' own) and vLLM's `prompt_logprobs`, scored by
`loopjax.score` (the identity path) in a thread while the engine generates (server.py)."""

from __future__ import annotations

import asyncio
import threading

from loopjax.openai_choice import Choice, prompt_logprobs
from loopjax.openai_errors import APIError, bad_request


class PromptScorer:
    """A server's scorer: each prompt's next-token log-probabilities (and the `top_k` most likely)
    at the depth and exit threshold a request runs with. One request's forwards at a time: each
    holds a whole sequence's activations."""

    def __init__(self, model, num_loops: int | None, engine_config):
        self.model, self.num_loops, self.engine_config = model, num_loops, engine_config
        self._lock = threading.Lock()

    def score(self, prompts: list[list[int]], params, top_k: int) -> list:
        from loopjax.scoring import score, score_options

        options = score_options(self.model, params, num_loops=self.num_loops,
                                engine_config=self.engine_config)
        with self._lock:
            return score(self.model, prompts, top_k=top_k, **options)


class PromptPart:
    """One request's prompt part, scored from creation where it asks one (`asked`): echo
    (completions only) or prompt_logprobs. Its prompts' choices share each prompt's score."""

    def __init__(self, scorer: PromptScorer, parser, body: dict, prompts: list[list[int]], params,
                 chat: bool, tokenizer):
        self.echo, self.k = bool(body.get("echo")) and not chat, params.prompt_logprobs
        self._parser, self._body, self._params, self._tokenizer = parser, body, params, tokenizer
        self._scores = None
        if self.echo or self.k is not None:
            top_k = max((params.logprobs or 0) if self.echo else 0, self.k or 0)
            self._scores = asyncio.ensure_future(asyncio.to_thread(scorer.score, prompts, params, top_k))
            # NOTE: a response that ends first (499, 503, an engine error) never awaits it: its
            # exception is retrieved here, not logged as "never retrieved"
            self._scores.add_done_callback(lambda done: done.cancelled() or done.exception())

    @property
    def asked(self) -> bool:
        return self._scores is not None

    async def resolve(self) -> tuple[list, list, list | None]:
        """Await the scores -> (the ScoreOutputs, prompt_logprobs per prompt in vLLM's shape (None
        where not asked), echo's (text, offsets) per prompt (None without echo)), one per prompt."""
        try:
            scored = await self._scores
        except ValueError as e:  # the scorer's one line (the prompts were checked before)
            raise bad_request(str(e), "echo" if self.echo else "prompt_logprobs") from None
        except Exception as e:  # e.g. the device ran out of memory: a 500 (a stream's last event)
            raise APIError(500, f"scoring the prompts failed: {type(e).__name__}: {e}", None,
                           "server_error") from None
        formatted = [None if self.k is None else prompt_logprobs(sc, self.k, self._tokenizer)
                     for sc in scored]
        echoed = None
        if self.echo:  # each prompt's text and its tokens' offsets (~3 us a token to decode: off the loop)
            echoed = await asyncio.to_thread(self._parser.echo_prompts, self._body,
                                             self._params.logprobs is not None)
        return scored, formatted, echoed

    def put(self, c: Choice, answer: dict, resolved: tuple) -> dict:
        """Completions choice `c`'s `answer` (the full one, or its stream's first chunk of tokens)
        with its prompt's part (`resolve`'s) before its text and logprobs."""
        scored, formatted, echoed = resolved
        p = c.index // self._params.n
        if self.echo:
            c.echo(answer, scored[p], self._params.logprobs or 0, echoed[p])
        if self.k is not None:
            answer["prompt_logprobs"] = formatted[p]
        return answer
