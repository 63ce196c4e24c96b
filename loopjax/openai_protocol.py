"""OpenAI request parsing for the server: a request body in, prompts and SamplingParams out.

Contract:
- Every refusal is an `APIError` (openai_errors.py) carrying OpenAI's error JSON `{"error":
  {"message", "type", "param", "code"}}` with a one-line message and `param` naming the field
  (HTTP 400 unless said otherwise); the server maps it to the response.
- Prompts come back as token-id lists checked against the vocabulary and the served context;
  text is encoded with the model's tokenizer, chat messages rendered by its chat template
  (openai_chat.py; loopjax/chat.py renders, shared with `LLM.chat`).
- `n` (samples per prompt) is an integer in [1, max_n]; `best_of` must equal it. The server
  submits `params.fan_out()` per prompt: choice `prompt_index * n + i` samples with seed + i.
- `echo` and `prompt_logprobs` score the prompt (streamed too): refused where the server's
  model cannot be scored or the request's exit rule is not one the identity path follows. A
  full answer's echo asks prompt_logprobs as vLLM's (`_echo_prompt_logprobs`).
- A chat request's own `chat_template` needs `trust_request_chat_template` (vLLM's
  --trust-request-chat-template); its `documents` are the template's variable.
Nothing here touches the engine.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from loopjax.detokenizer import IncrementalDetokenizer
from loopjax.generation_defaults import with_defaults
from loopjax.openai_chat import ChatRequests
from loopjax.openai_errors import APIError, bad_request
from loopjax.openai_sampling import with_lax_numbers, without_zero_max_completion_tokens
from loopjax.sampling_params import DEFAULT_MAX_N, SamplingParams, check_n, check_truncate_prompt_tokens

MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens")  # the first one given wins (vLLM's)


def _check_logprobs_type(body: dict, chat: bool) -> None:
    """`logprobs` is chat's switch (true / false) and completions' count (an integer); each
    endpoint reads the other's 0 / 1 / true / false as vLLM's pydantic does (completions' true is
    1, false 0: the sampled token's log p) and rewrites them as its own. Chat refuses any other
    integer (its `logprobs: 3` was taken as top-3)."""
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
        body["logprobs"] = int(value)


def _check_extension_fields(body: dict) -> None:
    """vLLM's fields that change no output here are accepted, of vLLM's pydantic's types (they
    were refused): `vllm_xargs` (an object of strings, numbers or lists of them, for its custom
    logits processors), `kv_transfer_params` and `ec_transfer_params` (objects, for its KV and
    encoder-cache connectors), as on a vLLM server without plugins or connectors; `session_id` (a
    string naming a conversation, for routing); `stream_interval` (an integer >= 1: tokens per
    streamed chunk; each chunk here holds what one engine step gave)."""
    xargs, session, interval = body.get("vllm_xargs"), body.get("session_id"), body.get("stream_interval")

    def scalar(v):
        return isinstance(v, str | int | float) and not isinstance(v, bool)

    if xargs is not None and not (isinstance(xargs, dict) and all(
            scalar(v) or (isinstance(v, list) and all(map(scalar, v))) for v in xargs.values())):
        raise bad_request(f"vllm_xargs must be an object of strings, numbers or lists of them, got "
                          f"{xargs!r:.80}", "vllm_xargs")
    for field in ("kv_transfer_params", "ec_transfer_params"):
        if body.get(field) is not None and not isinstance(body[field], dict):
            raise bad_request(f"{field} must be an object, got {body[field]!r:.80}", field)
    if session is not None and not isinstance(session, str):
        raise bad_request(f"session_id must be a string, got {session!r:.80}", "session_id")
    if interval is not None and not (type(interval) is int and interval >= 1):
        raise bad_request(f"stream_interval must be an integer >= 1, got {interval!r:.80}", "stream_interval")


def _field_with_lone_surrogate(raw: bytes, body: dict) -> str | None:
    """The first top-level field whose strings hold a lone UTF-16 surrogate (JSON's unpaired
    `"\\ud800"` escape parses to a str no tokenizer or encoder takes: it was a 500); "" for a
    field name that does. Only a body with a `\\ud` escape is walked."""
    if b"\\ud" not in raw.lower():
        return None
    for key, value in body.items():
        try:
            key.encode()
        except UnicodeEncodeError:
            return ""
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            return key
    return None


def param_of(message: str, body: dict) -> str | None:
    """The request field a one-line ValueError names (its first word that is a field)."""
    return next((w for w in re.findall(r"[A-Za-z_]+", message) if w in body or w == "max_tokens"), None)


def echo_state_of(model, engine_config) -> str | None:
    """A RequestParser's echo_state: the initial_state `loopjax.score` needs to score prompts as the
    engine runs them (`scoring.score_state`'s); "unsupported" where it cannot."""
    from loopjax.scoring import score_state

    try:
        return score_state(model, engine_config)
    except ValueError:
        return "unsupported"


@dataclasses.dataclass(frozen=True)
class RequestParser(ChatRequests):
    """What a served model accepts; `body`, `prompts` and `sampling` check one request (chat's
    messages: `ChatRequests`)."""

    model_name: str  # the name clients send as `model`
    tokenizer: Any = None  # a `tokenizers.Tokenizer`; None: token-id prompts only, no chat
    chat_template: str | None = None
    special_tokens: dict = dataclasses.field(default_factory=dict)  # chat.special_tokens: template variables
    vocab_size: int | None = None  # token ids must lie in [0, vocab_size)
    max_context: int | None = None  # prompt + generation tokens the engine serves
    max_n: int = DEFAULT_MAX_N  # samples per prompt, n in [1, max_n]
    max_logprobs: int | None = None  # top logprobs per token the engine returns; None: unchecked
    echo_state: str | None = "unsupported"  # `score`'s initial_state; "unsupported": no echo, prompt_logprobs
    trust_request_chat_template: bool = False  # a chat request may send its own chat_template (vLLM's flag)
    aliases: tuple[str, ...] = ()  # more names clients may send as `model` (vLLM's --served-model-name)
    # the model's sampling defaults (generation_defaults.py) for the fields a request leaves unset
    sampling_defaults: dict = dataclasses.field(default_factory=dict)

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
        if (field := _field_with_lone_surrogate(raw, body)) is not None:
            raise bad_request(f"{field or 'a field name'} holds a lone UTF-16 surrogate escape (such as "
                              f"\\ud800 unpaired): not Unicode text", field or None)
        body = without_zero_max_completion_tokens(with_lax_numbers(body))  # the checks below read them
        names = (self.model_name, *self.aliases)
        if body.get("model") is not None and body["model"] not in names:  # vLLM's (and OpenAI's) 404
            raise APIError(404, f"model {body['model']!r} does not exist here; this server serves "
                           f"{', '.join(map(repr, names))}", "model")
        # NOTE: read as flags: "false" would be true
        for key in ("stream", "echo", "return_token_ids", "return_tokens_as_token_ids", "return_token_strs",
                    "return_token_offsets", "return_mm_kwargs"):
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
        if options and not body.get("stream"):  # vLLM's 400 (an empty object passes, as there)
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        request_id = body.get("request_id")  # vLLM's: the response's id after its prefix
        if request_id is not None and not (isinstance(request_id, str) and request_id):
            raise bad_request(f"request_id must be a non-empty string, got {request_id!r}", "request_id")
        if body.get("user") is not None and not isinstance(body["user"], str):  # OpenAI's and vLLM's type
            raise bad_request(f"user must be a string, got {body['user']!r}", "user")
        if body.get("suffix"):  # accepted by from_openai, but this server cannot honour it
            raise bad_request("suffix is not supported by this server", "suffix")
        _check_extension_fields(body)
        return body

    def prompts(self, body: dict, chat: bool) -> list[list[int]]:
        """The token ids of each prompt: chat has one (the rendered messages); each cut to its
        last `truncate_prompt_tokens` (vLLM's field) before its length is checked; -1 (vLLM's)
        keeps what the context holds (`_truncation`)."""
        keep = self._truncation(body)
        for field in ("add_generation_prompt", "chat_template", "chat_template_kwargs", "documents",
                      "continue_final_message", "reasoning_effort"):
            if not chat and body.get(field) is not None:  # NOTE: refused, not ignored
                raise bad_request(f"{field} applies to /v1/chat/completions only", field)
        return [self._chat_prompt(body, keep)] if chat else self._completion_prompts(body, keep)

    @staticmethod
    def scores_only(body: dict, chat: bool) -> bool:
        """Completions' echo with max_tokens 0 (OpenAI's legacy scoring request, vLLM's): the
        prompts are scored and nothing is generated."""
        asked = next((body[k] for k in MAX_TOKENS_FIELDS if body.get(k) is not None), None)
        return type(asked) is int and asked == 0 and not chat and body.get("echo") is True

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
            raise bad_request(f"truncate_prompt_tokens={keep} exceeds {self._context()}",
                              "truncate_prompt_tokens")
        return keep

    def sampling(self, body: dict, chat: bool, prompts: list[list[int]]) -> SamplingParams:
        """The request's SamplingParams (`n` included, capped at max_n). A max_tokens the
        request sets must fit the context after its longest prompt (400 otherwise, as vLLM and
        OpenAI answer); the default one is cut to what fits. Chat's default (unset or null) is the
        model's max_new_tokens, else the whole room the prompt leaves; completions' is 16, a null
        one too (current vLLM's `normalize_null_max_tokens`; it was the room, vLLM's before). The
        other sampling fields a request leaves unset take the model's defaults
        (`sampling_defaults`, vLLM's)."""
        if self.scores_only(body, chat):  # checked as one token, which the server never asks for
            body = {**body, **{k: 1 for k in MAX_TOKENS_FIELDS if body.get(k) is not None}}
        if not chat:  # a null max_tokens is as absent: completions' default
            body = {k: v for k, v in body.items() if v is not None or k not in MAX_TOKENS_FIELDS}
        given = next((k for k in MAX_TOKENS_FIELDS if body.get(k) is not None), None)
        room = self.max_context - max(map(len, prompts)) if self.max_context else None
        body = with_defaults(body, self.sampling_defaults)
        if given is None and chat:  # the model's max_new_tokens, else None: until done (the room)
            body = {**body, "max_tokens": self.sampling_defaults.get("max_tokens")}
            least = body.get("min_tokens")
            if room and isinstance(least, int) and not isinstance(least, bool) and least > room:
                raise bad_request(f"min_tokens={least} does not fit: the prompt leaves {room} tokens of "
                                  f"{self._context()}", "min_tokens")
        _check_logprobs_type(body, chat)
        try:
            params = SamplingParams.from_openai(body)
            check_n(params.n, self.max_n, "this server's")
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), param_of(str(e), body)) from None
        if room is not None and given and params.max_tokens > room:
            raise bad_request(f"{given}={params.max_tokens} does not fit: the prompt has "
                              f"{self.max_context - room} tokens of {self._context()}", given)
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
        params = self._echo_prompt_logprobs(body, chat, params)
        if params.prompt_logprobs is not None:
            self._check_scorable("prompt_logprobs", body, params)
            if self.vocab_size is not None and params.prompt_logprobs > self.vocab_size:
                raise bad_request(f"prompt_logprobs={params.prompt_logprobs} exceeds the vocabulary of "
                                  f"{self.vocab_size}", "prompt_logprobs")
        return params

    def _echo_prompt_logprobs(self, body: dict, chat: bool, params: SamplingParams) -> SamplingParams:
        """vLLM's echo asks prompt_logprobs when the request sets none: completions' `logprobs`
        of them (none without it), chat's `top_logprobs` (0 without it); only in a full answer
        (vLLM's stream sends none). A chat whose prompt this server cannot score echoes text
        alone, as before (loopjax's chat echo never needed the scoring)."""
        if not body.get("echo") or params.prompt_logprobs is not None or body.get("stream"):
            return params
        top = (params.logprobs or 0) if chat else params.logprobs
        if top is None or (chat and self._unscorable(params)):
            return params
        return dataclasses.replace(params, prompt_logprobs=top)

    def _check_scorable(self, field: str, body: dict, params: SamplingParams) -> None:
        """`field` (echo, prompt_logprobs) asks the prompt's log-probabilities: a 400 naming it
        where `_unscorable`."""
        if (why := self._unscorable(params)) is not None:
            raise bad_request(why.replace("{field}", field), field)

    def _unscorable(self, params: SamplingParams) -> str | None:
        """Why this server cannot score `params`' prompts (a message of `{field}`), or None: they
        are scored on the identity path (loopjax.score) at a fixed depth or with Ouro's gate
        rules, as the reference computes every prompt position (in either exit_mode:
        `scoring.score_options`)."""
        if self.echo_state == "unsupported":
            return "{field} is not supported by this server (its prompts cannot be scored)"
        if params.exit_criterion is not None or params.exit_trace is not None:
            return ("{field} scores prompts at a fixed depth or with Ouro's exit gate; "
                    f"{params.exit_rule} is not supported with it")
        return None

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

    def _context(self) -> str:
        """The served context, as errors name it: OpenAI's and vLLM's words ("maximum context
        length"), which clients (LiteLLM, LangChain) look for to tell a context overflow."""
        return f"this server's maximum context length of {self.max_context} tokens"

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
            raise bad_request(f"{param} is too long: {len(ids)} tokens for {self._context()}", param)
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
