"""Chat messages -> prompt text, shared by the server (/v1/chat/completions, /tokenize) and
`LLM.chat`; imports neither FastAPI nor JAX.

Contract:
- `check_messages` takes OpenAI's message list: each a {role, content} object whose role is
  any string (vLLM's custom roles, OpenAI's deprecated "function" too: the template decides)
  and whose content is text, a list of text parts or strings (joined with newlines, as
  vLLM's) or null / absent (an assistant's tool-call turn: "", as vLLM's); any other part
  type (image_url, input_audio, file...) is refused, not dropped, as the model would answer
  without what the message asks about. It returns copies whose content is text, an
  assistant's `tool_calls` with each function's JSON `arguments` parsed into an object (vLLM's
  and transformers' templates' form).
- `render_chat` renders a Hugging Face chat template as transformers' `apply_chat_template`
  does (jinja2 sandboxed, its loop controls, `{% generation %}` blocks, `tojson`,
  `raise_exception`, `strftime_now`; `tools` and `documents` None unless given). jinja2 is a
  dependency: a built-in ChatML renderer, used without it, rendered templates that merely
  contain ChatML's markers (a default system prompt, `<think>`, trimming) differently.
- Refusals are one-line ValueErrors that start with `messages` (the server's 400 names that
  field).
- The rendered text is encoded without the tokenizer's special tokens (the template writes
  its own), as vLLM's chat does.
"""

from __future__ import annotations

import datetime
import functools
import json

from loopjax import tokenizer_files

TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}  # type: key


def check_messages(messages) -> list[dict]:
    """The conversation with each message's content as text; a one-line ValueError otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    clean = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else 0  # 0: no message, refused below
        content = "" if content is None else content  # null / absent (a tool-call turn): vLLM's ""
        if isinstance(content, list):  # content parts: text ones only (text must be text),
            # one per line, as vLLM joins them; a text part of null text is skipped (vLLM's)
            texts = [t for p in content if (t := _part_text(p, i)) is not _SKIPPED]
            content = "\n".join(texts) if all(isinstance(t, str) for t in texts) else None
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise ValueError(f"messages[{i}] must have a role (a string) and text content (or null)")
        clean.append(_parsed_tool_calls({**m, "content": content}, i))
    return clean


def _parsed_tool_calls(message: dict, i: int) -> dict:
    """`message` with an assistant's tool calls' arguments as objects: a JSON string parsed,
    none or "" as {} (vLLM's; templates render them with tojson, a string twice encoded)."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not isinstance(calls, list):
        return message
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ValueError(f"messages[{i}] has a tool call that is not {{id, type, function: {{name, "
                             f"arguments}}}}: {call!r:.60}")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise ValueError(f"messages[{i}] has tool call arguments that are not JSON: "
                                 f"{arguments!r:.60}") from None
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": parsed}


_SKIPPED = object()  # _part_text of a text part without text


def _part_text(part, i: int):
    """The text of a chat content part of a text type (a plain string too, as vLLM's); _SKIPPED
    when its text is null or absent (vLLM skips it); None when malformed; a ValueError for a part
    of another type."""
    if isinstance(part, str):
        return part
    kind = part.get("type", "text") if isinstance(part, dict) else None
    key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if isinstance(kind, str) and key is None:
        raise ValueError(f"messages[{i}] has a content part of type {kind!r}; this model takes text only")
    if not key:
        return None
    return _SKIPPED if part.get(key) is None else part[key]


def encode_chat(model, messages, *, chat_template: str | None = None, add_generation_prompt: bool = True,
                template_kwargs: dict | None = None, continue_final_message: bool = False) -> list[int]:
    """The token ids of one conversation for `model` (a loopjax Model): rendered by
    chat_template (default: the checkpoint's), encoded without the tokenizer's special tokens."""
    template = chat_template if chat_template is not None else model.chat_template
    if model.tokenizer is None or not template:
        raise ValueError("chat needs a tokenizer and a chat template: this model has no " +
                         ("tokenizer" if model.tokenizer is None else
                          "chat template (give one, or send the prompt text as it is)"))
    text = render_chat(template, check_messages(messages), add_generation_prompt=add_generation_prompt,
                       template_kwargs=template_kwargs, continue_final_message=continue_final_message,
                       special=special_tokens(model))
    return model.tokenize(text, add_special_tokens=False)


def render_chat(template: str, messages: list[dict], *, special: dict | None = None,
                add_generation_prompt: bool = True, template_kwargs: dict | None = None,
                continue_final_message: bool = False) -> str:
    """The prompt text of `messages` (checked ones) under a Hugging Face chat template; with
    add_generation_prompt, the opening of the assistant's turn follows. template_kwargs
    (vLLM's chat_template_kwargs, e.g. {"enable_thinking": false}) are more template
    variables; `special` the special tokens' (`special_tokens`; bos_token and eos_token ''
    where it lacks them), which template_kwargs override as transformers' kwargs do, but for
    the reserved bos_token and eos_token. continue_final_message
    (transformers' and vLLM's) ends the text with the final message's content, its turn left
    open for the model to go on (without add_generation_prompt)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("messages: continue_final_message and add_generation_prompt exclude each other "
                         "(the final message goes on; no new turn opens)")
    variables = {"bos_token": "", "eos_token": ""} | (special or {}) | check_template_kwargs(template_kwargs)
    text = _render(template, messages, add_generation_prompt, variables)
    if not continue_final_message:
        return text
    final = messages[-1]["content"]  # NOTE: templates that strip messages keep only the stripped
    if not final.strip():  # NOTE: transformers finds "" at the text's end: it keeps the whole text
        return text
    for content in (final, final.strip()):  # text; transformers looks for that too
        if content and (at := text.rfind(content)) >= 0:
            return text[:at + len(content)]
    raise ValueError("messages: continue_final_message needs the final message's text in the rendered "
                     "chat, and the chat template left it out")


def _render(template: str, messages: list[dict], add_generation_prompt: bool, extra: dict) -> str:
    from jinja2.exceptions import TemplateError

    check_template(template)  # a checkpoint's broken template is its fault, not the messages'
    try:
        # NOTE: transformers' variables: tools and documents are None unless given
        variables = dict(dict(tools=None, documents=None), **extra, messages=messages,
                         add_generation_prompt=add_generation_prompt)
        return _compiled(template).render(**variables)
    except TemplateError as e:
        raise ValueError(f"messages: the chat template refused them: {e}") from None
    except Exception as e:  # NOTE: the template's own code failed on these messages (a TypeError,
        # a ZeroDivisionError...): the checkpoint's template, not a bug here
        raise ValueError(f"messages: the chat template failed on them: {type(e).__name__}: {e}") from None


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """`template` compiled in transformers' apply_chat_template environment (jinja2 sandboxed):
    {% break %} / {% continue %}, {% generation %} blocks, its tojson, raise_exception and
    strftime_now. Kept: a server renders its one template per chat request."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(Extension):
        """{% generation %}...{% endgeneration %} (transformers marks the assistant's text with
        it, for training masks): its body, as rendered without the tags."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # NOTE: transformers' filter: jinja2's own escapes <, >, & and non-ASCII text
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", GenerationBlocks])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def check_template(template) -> None:
    """A chat template sent with a request (vLLM's chat_template): text that jinja2 compiles as
    transformers' environment does, or a one-line ValueError."""
    from jinja2.exceptions import TemplateError

    if not isinstance(template, str):
        raise ValueError(f"chat_template must be a string (a jinja2 chat template), got {template!r}")
    try:
        _compiled(template)
    except TemplateError as e:
        first = next(iter(str(e).splitlines()), "")
        raise ValueError(f"chat_template is not a jinja2 template: {type(e).__name__}: {first}") from None


_RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token")  # render's own variables


def check_template_kwargs(kwargs) -> dict:
    """chat_template_kwargs as a dict of template variables ({} for None), or a one-line ValueError."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise ValueError(f"chat_template_kwargs must be an object of template variables, got {kwargs!r}")
    if taken := sorted(set(kwargs) & set(_RESERVED)):
        raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)} (the renderer's own)")
    return dict(kwargs)


def special_tokens(model) -> dict:
    """The template variables of the checkpoint's special tokens, as transformers'
    apply_chat_template passes its special_tokens_map: bos_token, eos_token, unk_token,
    pad_token... and additional_special_tokens, those its files set (`tokenizer_files`;
    render_chat makes bos_token and eos_token '' where unset). A loopjax Model read them once
    (`Model.special_tokens`), for `LLM.chat`, `generate --chat` and the server alike; another
    object (a test's model, None) has them read from its `path`."""
    if isinstance(known := getattr(model, "special_tokens", None), dict):
        return known
    return tokenizer_files.special_tokens_map(getattr(model, "path", None))
