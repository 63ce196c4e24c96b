"""Chat requests' prompts for the server's `RequestParser` (openai_protocol.py), as vLLM's:
the messages (loopjax/chat.py's checks) rendered by the model's chat template or, where the
server trusts request templates, the request's own `chat_template`; `chat_template_kwargs` and
`documents` are the template's variables; the answer's role and `echo` text follow the last
message. Every refusal is a one-line 400 naming the field (`APIError`)."""

from __future__ import annotations

from loopjax.chat import check_messages, check_template, check_template_kwargs, render_chat
from loopjax.openai_errors import APIError, bad_request
from loopjax.openai_sampling import shown_tools

# vLLM's reasoning_effort values (OpenAI's, and DeepSeek V4's "max")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class ChatRequests:
    """RequestParser's chat half (a mixin: it reads the parser's tokenizer, chat_template,
    special_tokens and trust_request_chat_template, and its `_check_ids` / `_encode`)."""

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

    def template_problem(self) -> str | None:
        """Why the served chat template cannot render a one-user-message probe conversation (a
        one-line message), or None: it renders, or there is no chat to serve. The server warns of it
        once at start-up and keeps serving, as vLLM's chat template warm-up does (a template may
        refuse only this conversation: its requests still get the per-request 400)."""
        if self.tokenizer is None or not self.chat_template:
            return None
        try:
            self.tokenize({"messages": [{"role": "user", "content": "warmup"}]})
        except APIError as e:
            return e.message
        return None

    def _chat_prompt(self, body: dict, keep_last: int | None = None) -> list[int]:
        try:
            messages = check_messages(body.get("messages"))
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        template, kwargs = self._template(body)
        if self.tokenizer is None or not template:
            raise bad_request(f"model {self.model_name!r} has no chat template" +
                              ("" if self.tokenizer is not None else " or tokenizer") +
                              "; use /v1/completions with a prompt", "messages")
        generation, going_on = self._turn(body)
        try:
            text = render_chat(template, messages, add_generation_prompt=generation,
                               template_kwargs=kwargs, continue_final_message=going_on,
                               special=self.special_tokens)
        except ValueError as e:  # the template refused the messages, or failed on them
            own = template != self.chat_template  # the request's
            raise bad_request(str(e), "chat_template" if own else "messages") from None
        except RuntimeError as e:  # it cannot render on this installation
            raise APIError(500, str(e), "messages", "server_error") from None
        return self._check_ids(self._encode(text, "messages", body), "messages", keep_last)

    @staticmethod
    def _reasoning_variables(body: dict, kwargs: dict) -> dict:
        """vLLM's `reasoning_effort` as template variables: itself, and `enable_thinking` (false for
        "none") unless chat_template_kwargs set it; {} when not sent. A template that reads
        neither renders as without it, as vLLM's."""
        effort = body.get("reasoning_effort")
        if effort is None:
            return {}
        if not isinstance(effort, str) or effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                              f"{effort!r:.40}", "reasoning_effort")
        thinking = kwargs.get("enable_thinking", effort != "none")
        return {"reasoning_effort": effort, "enable_thinking": thinking}

    def _template(self, body: dict) -> tuple[str | None, dict]:
        """(the chat template, its variables: chat_template_kwargs' and vLLM's `documents`, a list
        of objects of strings, for RAG templates, and `tools` under tool_choice "none", shown to
        the model, no call parsed, as vLLM's), checked: the request's own
        `chat_template` (vLLM's field, or its chat_template_kwargs' `chat_template`, which wins
        there) where the server trusts request templates (vLLM's --trust-request-chat-template:
        a 400 otherwise), else the model's; an empty one is the model's (vLLM's)."""
        try:
            kwargs = check_template_kwargs(body.get("chat_template_kwargs"))
        except ValueError as e:
            raise bad_request(str(e), "chat_template_kwargs") from None
        documents = body.get("documents")
        if documents is not None:
            if not (isinstance(documents, list) and all(
                    isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents)):
                raise bad_request(f"documents must be a list of objects of strings (title, text...), got "
                                  f"{documents!r:.80}", "documents")
            kwargs["documents"] = documents
        if (tools := shown_tools(body)) is not None:
            if not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                       and isinstance(t["function"].get("name"), str) for t in tools):
                raise bad_request(f"tools must be a list of {{type, function: {{name, description, "
                                  f"parameters}}}} objects, got {tools!r:.80}", "tools")
            kwargs["tools"] = tools
        kwargs |= self._reasoning_variables(body, kwargs)
        sent = kwargs.pop("chat_template", None)
        sent = body.get("chat_template") if sent is None else sent
        if sent is None:
            return self.chat_template, kwargs
        if not self.trust_request_chat_template:
            raise bad_request("a request's chat_template needs a server started with "
                              "--trust-request-chat-template (as vLLM's)", "chat_template")
        try:
            check_template(sent)
        except ValueError as e:
            raise bad_request(str(e), "chat_template") from None
        return sent or self.chat_template, kwargs
