"""OpenAI request parsing for the server: a request body in, prompts and SamplingParams out.

Contract:
- Every refusal is an `APIError` carrying OpenAI's error JSON `{"error": {"message", "type",
  "param", "code"}}` with a one-line message and `param` naming the field (HTTP 400 unless
  said otherwise); the server maps it to the response.
- Prompts come back as token-id lists checked against the vocabulary and the served context;
  text is encoded with the model's tokenizer, chat messages rendered by its chat template
  (loopjax/chat.py, shared with `LLM.chat`).
- `n` (samples per prompt) is an integer in [1, max_n]; `best_of` must equal it. The server
  submits `params.fan_out()` per prompt: choice `prompt_index * n + i` samples with seed + i.
- `echo` and `prompt_logprobs` score the prompt (streamed too): refused where the server's
  model cannot be scored or the request's exit rule is not one the identity path follows.
This module imports FastAPI for the error response only; nothing here touches the engine.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from fastapi.responses import JSONResponse

from loopjax.chat import check_messages, check_template_kwargs, render_chat
from loopjax.detokenizer import IncrementalDetokenizer
from loopjax.sampling_params import DEFAULT_MAX_N, SamplingParams, check_n, check_truncate_prompt_tokens

MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        return JSONResponse({"error": error}, status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def internal_error(e: Exception) -> APIError:
    """A bug's 500: one line naming the exception."""
    first_line = next(iter(str(e).splitlines()), "")
    return APIError(500, f"internal server error: {type(e).__name__}: {first_line}".rstrip(": "), None,
                    "server_error")


def _check_logprobs_type(body: dict, chat: bool) -> None:
    """`logprobs` is chat's switch (true / false; 0 and 1 too, as vLLM's pydantic reads them) and
    completions' count (an integer): either endpoint refuses the other's (chat's `logprobs: 3`
    was taken as top-3). Chat's 0 / 1 are rewritten as the bools they stand for."""
    value = body.get("logprobs")
    if value is None:
        return
    if chat:
        if type(value) is int and value in (0, 1):
            body["logprobs"] = bool(value)
        elif not isinstance(value, bool):
            raise bad_request(f"logprobs must be true or false on /v1/chat/completions (top_logprobs is the "
                              f"count), got {value!r}", "logprobs")
    elif isinstance(value, bool):
        raise bad_request(f"logprobs must be an integer (the top log-probabilities per token) on "
                          f"/v1/completions, got {value!r}", "logprobs")


def param_of(message: str, body: dict) -> str | None:
    """The request field a one-line ValueError names (its first word that is a field)."""
    return next((w for w in re.findall(r"[A-Za-z_]+", message) if w in body or w == "max_tokens"), None)


@dataclasses.dataclass(frozen=True)
class RequestParser:
    """What a served model accepts; `body`, `prompts` and `sampling` check one request."""

    model_name: str  # the name clients send as `model`
    tokenizer: Any = None  # a `tokenizers.Tokenizer`; None: token-id prompts only, no chat
    chat_template: str | None = None
    special_tokens: dict = dataclasses.field(default_factory=dict)  # bos_token / eos_token text
    vocab_size: int | None = None  # token ids must lie in [0, vocab_size)
    max_context: int | None = None  # prompt + generation tokens the engine serves
    max_n: int = DEFAULT_MAX_N  # samples per prompt, n in [1, max_n]
    max_logprobs: int | None = None  # top logprobs per token the engine returns; None: unchecked
    echo_state: str | None = "unsupported"  # `score`'s initial_state; "unsupported": no echo, prompt_logprobs

    def __post_init__(self):
        if isinstance(self.max_n, bool) or not isinstance(self.max_n, int) or self.max_n < 1:
            raise ValueError(f"max_n must be an integer >= 1, got {self.max_n!r}")

    def body(self, raw: bytes) -> dict:
        """The request's JSON object, its `model`, `stream` and unsupported fields checked."""
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"malformed JSON body: {e}") from None
        except RecursionError:  # arrays or objects nested past Python's recursion limit
            raise bad_request("malformed JSON body: nested too deeply") from None
        if not isinstance(body, dict):
            raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
        if body.get("model") is not None and body["model"] != self.model_name:
            raise APIError(404, f"model {body['model']!r} does not exist here; this server serves "
                           f"{self.model_name!r}", "model")  # vLLM's (and OpenAI's) status
        # NOTE: read as flags: "false" would be true
        for key in ("stream", "echo", "return_token_ids", "return_tokens_as_token_ids", "return_token_strs"):
            if body.get(key) is not None and not isinstance(body[key], bool):
                raise bad_request(f"{key} must be true or false, got {body[key]!r}", key)
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):  # the server reads its fields
            raise bad_request(f"stream_options must be an object, got {options!r}", "stream_options")
        for key in ("include_usage", "continuous_usage_stats"):  # OpenAI's; vLLM's
            value = (options or {}).get(key)
            if value is not None and not isinstance(value, bool):
                raise bad_request(f"stream_options.{key} must be true or false, got {value!r}",
                                  "stream_options")
        if body.get("stream_options") is not None and not body.get("stream"):  # OpenAI's and vLLM's 400
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        request_id = body.get("request_id")  # vLLM's: the response's id after its prefix
        if request_id is not None and not (isinstance(request_id, str) and request_id):
            raise bad_request(f"request_id must be a non-empty string, got {request_id!r}", "request_id")
        if body.get("user") is not None and not isinstance(body["user"], str):  # OpenAI's and vLLM's type
            raise bad_request(f"user must be a string, got {body['user']!r}", "user")
        if body.get("suffix"):  # accepted by from_openai, but this server cannot honour it
            raise bad_request("suffix is not supported by this server", "suffix")
        return body

    def prompts(self, body: dict, chat: bool) -> list[list[int]]:
        """The token ids of each prompt: chat has one (the rendered messages); each cut to its
        last `truncate_prompt_tokens` (vLLM's field) before its length is checked; -1 (vLLM's)
        keeps what the context holds (`_truncation`)."""
        keep = self._truncation(body)
        for field in ("add_generation_prompt", "chat_template_kwargs", "continue_final_message"):
            if not chat and body.get(field) is not None:  # NOTE: refused, not ignored
                raise bad_request(f"{field} applies to /v1/chat/completions only", field)
        return [self._chat_prompt(body, keep)] if chat else self._completion_prompts(body, keep)

    @staticmethod
    def scores_only(body: dict, chat: bool) -> bool:
        """Completions' echo with max_tokens 0 (OpenAI's legacy scoring request, vLLM's): the
        prompts are scored and nothing is generated."""
        zero = [k for k in MAX_TOKENS_FIELDS if type(body.get(k)) is int and body[k] == 0]
        return bool(zero) and not chat and body.get("echo") is True

    def _truncation(self, body: dict) -> int | None:
        """truncate_prompt_tokens, checked; -1 becomes the prompt tokens the context holds with
        room for the max_tokens asked (for one token when none is): the body then carries that
        count, which the engine and echo read."""
        keep = body.get("truncate_prompt_tokens")
        if keep == -1 and type(keep) is int:
            if self.max_context is None:  # no limit known: nothing to cut to
                del body["truncate_prompt_tokens"]
                return None
            asked = next((body[k] for k in MAX_TOKENS_FIELDS if body.get(k) is not None), None)
            fits = type(asked) is int and 0 < asked < self.max_context
            keep = body["truncate_prompt_tokens"] = self.max_context - (asked if fits else 1)
        try:
            check_truncate_prompt_tokens(keep)
        except ValueError:
            raise bad_request(f"truncate_prompt_tokens must be an integer >= 1, or -1 (what the context "
                              f"holds), got {keep!r}", "truncate_prompt_tokens") from None
        if keep is not None and self.max_context is not None and keep > self.max_context:  # vLLM's 400
            raise bad_request(f"truncate_prompt_tokens={keep} exceeds this server's context of "
                              f"{self.max_context}", "truncate_prompt_tokens")
        return keep

    def sampling(self, body: dict, chat: bool, prompts: list[list[int]]) -> SamplingParams:
        """The request's SamplingParams (`n` included, capped at max_n). A max_tokens the
        request sets must fit the context after its longest prompt (400 otherwise, as vLLM and
        OpenAI answer); the default one is cut to what fits. Chat's default, and an explicit
        null max_tokens on either endpoint (vLLM's), is the whole room the prompt leaves;
        completions' default is 16."""
        if self.scores_only(body, chat):  # checked as one token, which the server never asks for
            body = {**body, **{k: 1 for k in MAX_TOKENS_FIELDS if body.get(k) is not None}}
        given = next((k for k in MAX_TOKENS_FIELDS if body.get(k) is not None), None)
        room = self.max_context - max(map(len, prompts)) if self.max_context else None
        unbounded = chat or any(k in body for k in MAX_TOKENS_FIELDS)  # given, or sent as null
        if given is None and unbounded:
            body = {**body, "max_tokens": None}  # SamplingParams' None: until done (the room)
            least = body.get("min_tokens")
            if room and isinstance(least, int) and not isinstance(least, bool) and least > room:
                raise bad_request(f"min_tokens={least} does not fit: the prompt leaves {room} tokens of "
                                  f"this server's context of {self.max_context}", "min_tokens")
        _check_logprobs_type(body, chat)
        try:
            params = SamplingParams.from_openai(body)
            check_n(params.n, self.max_n, "this server's")
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), param_of(str(e), body)) from None
        if room is not None and given and params.max_tokens > room:
            raise bad_request(f"{given}={params.max_tokens} does not fit: the prompt has "
                              f"{self.max_context - room} tokens of this server's context of "
                              f"{self.max_context}", given)
        if room is not None and params.output_budget(room) != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=params.output_budget(room))
        if params.stop and self.tokenizer is None:  # NOTE: the server, not the engine, matches them
            raise bad_request("stop strings need a tokenizer; this model has none (use stop_token_ids)",
                              "stop")
        # NOTE: checked here, not left to the engine, so the error names the field sent (chat's
        # top_logprobs becomes SamplingParams.logprobs); prompt_logprobs is capped too, as vLLM's
        for field, value in (("top_logprobs" if chat else "logprobs", params.logprobs),
                             ("prompt_logprobs", params.prompt_logprobs)):
            if self.max_logprobs is not None and (value or 0) > self.max_logprobs:
                raise bad_request(f"{field} must be at most {self.max_logprobs} (this server's "
                                  f"max_logprobs), got {value}", field)
        if body.get("echo") and not chat:  # NOTE: chat's echo is text the request sent (chat_reply)
            self._check_scorable("echo", body, params)
        if params.prompt_logprobs is not None:
            self._check_scorable("prompt_logprobs", body, params)
            if self.vocab_size is not None and params.prompt_logprobs > self.vocab_size:
                raise bad_request(f"prompt_logprobs={params.prompt_logprobs} exceeds the vocabulary of "
                                  f"{self.vocab_size}", "prompt_logprobs")
        return params

    def _check_scorable(self, field: str, body: dict, params: SamplingParams) -> None:
        """`field` (echo, prompt_logprobs) asks the prompt's log-probabilities, scored on the
        identity path (loopjax.score): a fixed depth or Ouro's threshold exit in select mode, as
        the reference computes every prompt position."""
        if self.echo_state == "unsupported":
            raise bad_request(f"{field} is not supported by this server (its prompts cannot be scored)",
                              field)
        rule = params.exit_rule
        if rule or params.exit_mode != "select":
            raise bad_request(f"{field} scores prompts at a fixed depth or with Ouro's threshold exit in "
                              f"select mode; {rule or 'exit_mode=' + params.exit_mode} is not supported "
                              f"with it", field)

    def tokenize(self, body: dict) -> list[int]:
        """/tokenize: the token ids of one `prompt` (text or ids) or of chat `messages` rendered
        by the chat template, as the completions would see them; any length (the client
        compares the count with max_model_len)."""
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise bad_request("give either prompt or messages", "prompt")
        unbounded = dataclasses.replace(self, max_context=None)
        if body.get("messages") is not None:
            return unbounded._chat_prompt(body)
        prompts = unbounded._completion_prompts(body)
        if len(prompts) != 1:
            raise bad_request(f"prompt must be one text or one list of token ids, got {len(prompts)}",
                              "prompt")
        return prompts[0]

    def detokenize(self, body: dict) -> str:
        """/detokenize: the text of `tokens`, special tokens kept (the inverse of /tokenize)."""
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise bad_request("tokens must be a list of integer token ids", "tokens")
        if self.tokenizer is None:
            raise bad_request(f"model {self.model_name!r} has no tokenizer to detokenize with", "tokens")
        if tokens:
            dataclasses.replace(self, max_context=None)._check_ids(tokens, "tokens")
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def _check_ids(self, ids, param: str, keep_last: int | None = None) -> list[int]:
        if not ids:
            raise bad_request(f"{param} is empty", param)
        # NOTE: builtins over the whole list (a 512-id prompt: ~1 ms per request as per-id
        # Python checks, parsed one request at a time on the event loop, run 26); JSON gives
        # int (bool is not int here: `type`, not isinstance)
        if not set(map(type, ids)) <= {int}:
            raise bad_request(f"{param} must be text or a list of integer token ids", param)
        if self.vocab_size is not None and not (min(ids) >= 0 and max(ids) < self.vocab_size):
            raise bad_request(f"{param} has token ids outside [0, {self.vocab_size})", param)
        ids = ids[-keep_last:] if keep_last else ids
        if self.max_context is not None and len(ids) >= self.max_context:
            raise bad_request(f"{param} is too long: {len(ids)} tokens for a context of "
                              f"{self.max_context}", param)
        return ids

    def _encode(self, text: str, param: str, body: dict) -> list[int]:
        return self._encoding(text, param, body).ids

    def _encoding(self, text: str, param: str, body: dict):
        """The `tokenizers.Encoding` of a text prompt (the tokenizer's special tokens added, as
        vLLM's and HF's default) or of rendered chat messages (none: the template writes them);
        vLLM's `add_special_tokens` field overrides either."""
        if self.tokenizer is None:
            raise bad_request(f"{param}: model {self.model_name!r} has no tokenizer; send token ids "
                              "instead", param)
        special = body.get("add_special_tokens")
        if special is not None and not isinstance(special, bool):
            raise bad_request(f"add_special_tokens must be true or false, got {special!r}",
                              "add_special_tokens")
        return self.tokenizer.encode(text, add_special_tokens=(param == "prompt") if special is None
                                     else special)

    def echo_prompts(self, body: dict, offsets: bool) -> list[tuple[str, list[int] | None] | None]:
        """echo's part of each (checked) completions prompt, as vLLM echoes it: the text as
        given, or the decode of the token ids given (special tokens kept); and, if `offsets`
        (logprobs' text_offset), where each prompt token starts in it: the tokenizer's offsets
        of the text it encoded, the incremental decode's of ids (~3 us a token, so only then).
        A prompt truncate_prompt_tokens cut is echoed as the decode of the ids that ran. None
        without a tokenizer."""
        if self.tokenizer is None:
            return [None] * len(self._prompt_items(body))
        keep = body.get("truncate_prompt_tokens")  # checked by `prompts`
        echoed = []
        for p in self._prompt_items(body):
            if isinstance(p, str) and keep:
                ids = self._encoding(p, "prompt", body).ids
                p = p if len(ids) <= keep else ids
            if isinstance(p, str):
                encoding = self._encoding(p, "prompt", body) if offsets else None
                echoed.append((p, None if encoding is None else [start for start, _ in encoding.offsets]))
                continue
            p = p[-keep:] if keep else p
            if offsets:
                text = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=False)
                text.update(p, final=True)
                echoed.append((text.text, text.offsets))
            else:
                echoed.append((self.tokenizer.decode(p, skip_special_tokens=False), None))
        return echoed

    def _prompt_items(self, body: dict) -> list:
        """The completions prompts as given: each a text or a list of token ids."""
        prompt = body.get("prompt")
        one = isinstance(prompt, list) and prompt and not isinstance(prompt[0], str | list)
        if isinstance(prompt, str) or one:  # one prompt (its token ids are checked later)
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str | list) for p in prompt):
            raise bad_request("prompt must be text, token ids, or a non-empty list of those", "prompt")
        return prompt

    def _completion_prompts(self, body: dict, keep_last: int | None = None) -> list[list[int]]:
        return [self._check_ids(self._encode(p, "prompt", body) if isinstance(p, str) else p, "prompt",
                                keep_last) for p in self._prompt_items(body)]

    def chat_reply(self, body: dict) -> tuple[str, str]:
        """A (checked) chat request's answer role and echo text, as vLLM's: the assistant's role,
        or without a generation prompt the last message's (its turn goes on); with `echo`, the
        last message's content when its role is the answer's, put before each choice's text
        ("" otherwise)."""
        messages = check_messages(body["messages"])
        role = "assistant" if self._turn(body)[0] else messages[-1]["role"]
        echoed = messages[-1]["content"] if body.get("echo") and messages[-1]["role"] == role else ""
        return role, echoed

    @staticmethod
    def _turn(body: dict) -> tuple[bool, bool]:
        """(add_generation_prompt, continue_final_message), checked.
        NOTE: continue_final_message alone turns add_generation_prompt off (vLLM asks for both)."""
        going_on = body.get("continue_final_message", False)
        generation = body.get("add_generation_prompt", not going_on)
        for field, value in (("add_generation_prompt", generation), ("continue_final_message", going_on)):
            if not isinstance(value, bool):
                raise bad_request(f"{field} must be true or false, got {value!r}", field)
        if generation and going_on:
            raise bad_request("continue_final_message and add_generation_prompt exclude each other (the "
                              "final message goes on; no new turn opens)", "continue_final_message")
        return generation, going_on

    def _chat_prompt(self, body: dict, keep_last: int | None = None) -> list[int]:
        try:
            messages = check_messages(body.get("messages"))
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        if self.tokenizer is None or not self.chat_template:
            raise bad_request(f"model {self.model_name!r} has no chat template" +
                              ("" if self.tokenizer is not None else " or tokenizer") +
                              "; use /v1/completions with a prompt", "messages")
        generation, going_on = self._turn(body)
        try:
            kwargs = check_template_kwargs(body.get("chat_template_kwargs"))
        except ValueError as e:
            raise bad_request(str(e), "chat_template_kwargs") from None
        try:
            text = render_chat(self.chat_template, messages, add_generation_prompt=generation,
                               template_kwargs=kwargs, continue_final_message=going_on, **self.special_tokens)
        except ValueError as e:  # the template refused the messages, or failed on them
            raise bad_request(str(e), "messages") from None
        except RuntimeError as e:  # it cannot render on this installation
            raise APIError(500, str(e), "messages", "server_error") from None
        return self._check_ids(self._encode(text, "messages", body), "messages", keep_last)
