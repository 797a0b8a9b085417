"""The OpenAI API's request and response objects, without I/O: request bodies (already
decoded JSON) in, checked parameters out; engine results in, OpenAI-shaped objects out.
``_http_api.py`` moves them over HTTP.

Parameters follow OpenAI's names and defaults (``temperature`` 1, ``max_tokens`` 16 for
completions), plus three extensions: ``top_k``, ``ignore_eos`` and ``max_tokens`` up to the
context for chat. A parameter this server does not implement is refused with HTTP 400
naming it, unless it is given its neutral value (``n: 1``, ``echo: false``...); an unknown
one is refused too, as OpenAI does, so a typo never passes silently. A string anywhere in a
body that is not Unicode text (a lone UTF-16 surrogate such as JSON's ``"\ud800"``) is
refused with HTTP 400 naming where it is, before any parameter is read."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from backbone.engine._batch import Finish, InvalidRequest, Sampling, StreamEvent, Summary

__all__ = ["ApiError", "ChatParams", "CompletionParams", "Prompt", "chat_chunk", "chat_object",
           "chat_prompt_ids", "check_text", "completion_chunk", "completion_object", "error_for_event",
           "error_for_invalid", "finish_reason", "parse_chat", "parse_completion", "usage"]

# Several prompts in one /v1/completions request are several engine requests.
MAX_PROMPTS = 64
CHAT_ROLES = ("system", "developer", "user", "assistant")

# Engine field names -> OpenAI parameter names.
_PARAMS = {"prompt_token_ids": "prompt", "sampling.temperature": "temperature", "sampling.top_p": "top_p",
           "sampling.top_k": "top_k", "sampling.seed": "seed"}
# error_kind of a failed stream -> (HTTP status, error type).
_EVENT_ERRORS = {"unavailable": (503, "server_error"), "aborted": (500, "server_error"),
                 "internal": (500, "server_error")}


class ApiError(Exception):
    """A request answered with an OpenAI error object: ``{"error": {message, type, param,
    code}}`` and ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_for_invalid(exc: InvalidRequest, *, prompt_param: str = "prompt") -> ApiError:
    """The 400 (404 for the model) for the engine's or the backbone's InvalidRequest, naming
    the OpenAI parameter at fault (``prompt_param`` for the prompt: ``messages`` in chat)."""
    message = str(exc).removeprefix(f"{exc.field}: ")
    if exc.field == "model":
        return ApiError(404, f"model: {message}", param="model", code="model_not_found")
    base = exc.field.split("[")[0]
    param = _PARAMS.get(base, base)
    if param == "prompt":
        param = prompt_param
    return ApiError(400, f"{param}{exc.field[len(base):]}: {message}", param=param)


def error_for_event(event: StreamEvent) -> ApiError:
    """The error object for a stream that ended with ``event.error``."""
    status, kind = _EVENT_ERRORS.get(event.error_kind, (500, "server_error"))
    return ApiError(status, event.error or "the decode failed", type=kind, code=event.error_kind or None)


# -- text ------------------------------------------------------------------------------

def _surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in ``text``, or None. json.loads makes one from a
    "\\ud800" escape with no partner, or from the UTF-8 bytes of a surrogate (ED A0 80)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _surrogate_error(where: str | None, what: str, text: str, at: int) -> ApiError:
    code = f"\\u{ord(text[at]):04x}"
    place = f"{where}: " if where else ""
    return ApiError(400, f"{place}{what} holds a lone UTF-16 surrogate ({code}, at character {at}), which is no "
                         "Unicode character: in JSON a \\ud800-\\udbff escape must be followed by a "
                         "\\udc00-\\udfff one (the two encode one character), or send the character itself "
                         "as UTF-8", param=where)


def check_text(body: object) -> None:
    """ApiError (400) when a string in ``body`` (decoded JSON), or a key of one of its
    objects, holds a lone surrogate: it cannot be tokenized nor written back as UTF-8. The
    error's ``param`` is where: ``prompt``, ``prompt[1]``, ``messages[0].content``..."""
    stack: list[tuple[str | None, object]] = [(None, body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            at = _surrogate(value)
            if at is not None:
                raise _surrogate_error(where, "the text" if where else "the body", value, at)
        elif isinstance(value, dict):
            for key, item in value.items():
                at = _surrogate(key)
                if at is not None:
                    raise _surrogate_error(where, "a name", key, at)
                stack.append((f"{where}.{key}" if where else key, item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]" if where else f"[{i}]", item) for i, item in enumerate(value)
                         if isinstance(item, (str, dict, list)))


# -- parameters ------------------------------------------------------------------------

Prompt = str | list[int]


@dataclasses.dataclass(frozen=True)
class _Common:
    model: str
    max_tokens: int | None  # None: up to the context (chat only)
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool


@dataclasses.dataclass(frozen=True)
class CompletionParams(_Common):
    prompts: list[Prompt]


@dataclasses.dataclass(frozen=True)
class ChatParams(_Common):
    messages: list[dict[str, str]]


def _neutral(*values: object) -> Callable[[object], bool]:
    return lambda v: any(v is x or (type(v) is type(x) and v == x) for x in values)


def _zero(v: object) -> bool:
    return v is None or (type(v) in (int, float) and v == 0)


# Parameters both endpoints know; a value other than the neutral one is refused.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "n", "ignore_eos", "user"}
_COMMON_NEUTRAL: dict[str, Callable[[object], bool]] = {
    "presence_penalty": _zero, "frequency_penalty": _zero, "logit_bias": _neutral(None, {}),
}
_COMPLETION = _COMMON | {"prompt"}
_COMPLETION_NEUTRAL = {**_COMMON_NEUTRAL, "logprobs": _neutral(None), "echo": _neutral(None, False),
                       "best_of": _neutral(None, 1), "suffix": _neutral(None, "")}
_CHAT = _COMMON | {"messages", "max_completion_tokens"}
_CHAT_NEUTRAL = {**_COMMON_NEUTRAL, "logprobs": _neutral(None, False), "top_logprobs": _neutral(None, 0),
                 "tools": _neutral(None, []), "tool_choice": _neutral(None, "none", "auto"),
                 "parallel_tool_calls": _neutral(None, True, False),
                 "response_format": _neutral(None, {"type": "text"}),
                 "store": _neutral(None, False), "metadata": _neutral(None, {})}


def _check_names(body: Mapping[str, Any], known: set[str], neutral: Mapping[str, Callable[[object], bool]]) -> None:
    for name, value in body.items():
        if name in known:
            continue
        if name in neutral:
            if not neutral[name](value):
                raise ApiError(400, f"{name}: not supported by this server (leave it out)", param=name)
            continue
        raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name)


def _kind(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _int(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not int:
        raise ApiError(400, f"{name}: must be an integer, got {_kind(value)}", param=name)
    return value


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if type(value) not in (int, float):
        raise ApiError(400, f"{name}: must be a number, got {_kind(value)}", param=name)
    return float(value)


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if type(value) is not bool:
        raise ApiError(400, f"{name}: must be true or false, got {_kind(value)}", param=name)
    return value


def _common(body: Mapping[str, Any], max_tokens: int | None) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model: must be a string, got {_kind(model)}", param="model")
    n = _int(body, "n", 1)
    if n != 1:
        raise ApiError(400, f"n: only 1 choice per prompt is supported, got {n}", param="n")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens: must be at least 1, got {max_tokens}", param="max_tokens")
    top_k = _int(body, "top_k", 0)
    assert top_k is not None
    if top_k == -1:  # vLLM's "off"
        top_k = 0
    seed = _int(body, "seed", None)
    sampling = Sampling(temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
                        top_k=top_k, seed=seed)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise ApiError(400, "stop: must be a string or an array of strings", param="stop")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise ApiError(400, 'stream_options: the only option is {"include_usage": true|false}',
                           param="stream_options")
        if not stream:
            raise ApiError(400, "stream_options: only with stream: true", param="stream_options")
        include_usage = _bool(options, "include_usage")
    return dict(model=model or "", max_tokens=max_tokens, sampling=sampling, stop=stops, stream=stream,
                include_usage=include_usage, ignore_eos=_bool(body, "ignore_eos"))


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _prompts(body: Mapping[str, Any]) -> list[Prompt]:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "prompt: required (a string, an array of strings, an array of token ids, or an "
                            "array of such arrays)", param="prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        prompts: list[Prompt] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise ApiError(400, "prompt: must be a string, an array of strings, a non-empty array of token ids, or an "
                            "array of such arrays", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    return prompts


def parse_completion(body: Mapping[str, Any]) -> CompletionParams:
    """/v1/completions' parameters; ApiError (400) names the one at fault."""
    check_text(body)
    _check_names(body, _COMPLETION, _COMPLETION_NEUTRAL)
    prompts = _prompts(body)
    return CompletionParams(prompts=prompts, **_common(body, _int(body, "max_tokens", 16)))


def _content(i: int, content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(400, f"messages[{i}].content[{j}]: only text parts ({{\"type\": \"text\", "
                                    "\"text\": ...}}) are supported", param=f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"messages[{i}].content: must be a string or an array of text parts, got {_kind(content)}",
                   param=f"messages[{i}].content")


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: required, a non-empty array of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}]: must be an object with role and content", param=f"messages[{i}]")
        extra = set(message) - {"role", "content", "name"}
        if extra:
            name = sorted(extra)[0]
            raise ApiError(400, f"messages[{i}].{name}: not supported by this server", param=f"messages[{i}].{name}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                           param=f"messages[{i}].role")
        content = message.get("content")
        out.append({"role": role, "content": "" if content is None and role == "assistant" else _content(i, content)})
    return out


def parse_chat(body: Mapping[str, Any]) -> ChatParams:
    """/v1/chat/completions' parameters; ApiError (400) names the one at fault."""
    check_text(body)
    _check_names(body, _CHAT, _CHAT_NEUTRAL)
    messages = _messages(body)
    max_tokens = _int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None)
    elif body.get("max_tokens") is not None:
        raise ApiError(400, "max_tokens: give max_tokens or max_completion_tokens, not both", param="max_tokens")
    return ChatParams(messages=messages, **_common(body, max_tokens))


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The prompt of a chat: ``messages`` through the checkpoint's chat template, ending with
    the assistant's opening. ApiError (400, ``messages``) when the checkpoint has no
    template or the template refuses the messages."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "messages: this model's checkpoint has no chat template (chat_template in "
                            "tokenizer_config.json or chat_template.jinja); use /v1/completions with a prompt "
                            "formatted as the model expects", param="messages")
    try:
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # the template's own checks (raise_exception) or jinja's errors
        raise ApiError(400, f"messages: the model's chat template refused them: {exc}", param="messages") from None
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return [int(t) for t in ids]


# -- responses -------------------------------------------------------------------------

def finish_reason(summary: Summary) -> str:
    """OpenAI's finish_reason: the end of the model's turn and a stop string are both "stop"."""
    return "length" if summary.finish is Finish.LENGTH else "stop"


def usage(summaries: Sequence[Summary]) -> dict[str, int]:
    prompt = sum(s.prompt_tokens for s in summaries)
    completion = sum(s.completion_tokens for s in summaries)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_object(id: str, created: int, model: str, texts: Sequence[str],
                      summaries: Sequence[Summary]) -> dict[str, Any]:
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"text": text, "index": i, "logprobs": None, "finish_reason": finish_reason(s)}
                        for i, (text, s) in enumerate(zip(texts, summaries))],
            "usage": usage(summaries)}


def completion_chunk(id: str, created: int, model: str, index: int, text: str, finish: str | None,
                     with_usage: bool) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"text": text, "index": index, "logprobs": None, "finish_reason": finish}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def chat_object(id: str, created: int, model: str, text: str, summary: Summary) -> dict[str, Any]:
    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason(summary)}],
            "usage": usage([summary])}


def chat_chunk(id: str, created: int, model: str, delta: dict[str, str], finish: str | None,
               with_usage: bool) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if with_usage:
        chunk["usage"] = None
    return chunk
