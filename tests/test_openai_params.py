"""The OpenAI API's parameters and objects (backbone/service/_openai_shapes.py), without a server: what is
accepted, what is refused and which parameter the error names."""

from __future__ import annotations

from typing import Any

import pytest

from backbone.engine._batch import Finish, InvalidRequest, Sampling, StreamEvent, Summary
from backbone.service._openai_shapes import (
    MAX_PROMPTS,
    ApiError,
    chat_prompt_ids,
    completion_object,
    error_for_event,
    error_for_invalid,
    parse_chat,
    parse_completion,
)


def _refused(parse: Any, body: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body)
    return caught.value


def test_completion_defaults_follow_openai() -> None:
    p = parse_completion({"prompt": "Hello"})
    assert p.prompts == ["Hello"] and p.max_tokens == 16 and p.model == ""
    assert p.sampling == Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=None)
    assert (p.stop, p.stream, p.include_usage, p.ignore_eos) == ((), False, False, False)


def test_completion_parameters() -> None:
    p = parse_completion({"model": "m", "prompt": [[1, 2], "x"], "max_tokens": 3, "temperature": 0, "top_p": 0.5,
                          "top_k": -1, "seed": 7, "stop": "\n", "stream": True,
                          "stream_options": {"include_usage": True}, "ignore_eos": True, "n": 1, "echo": False,
                          "logprobs": None, "best_of": 1, "presence_penalty": 0, "user": "me"})
    assert p.prompts == [[1, 2], "x"] and p.max_tokens == 3 and p.stop == ("\n",)
    assert p.sampling == Sampling(temperature=0.0, top_p=0.5, top_k=0, seed=7)
    assert p.stream and p.include_usage and p.ignore_eos
    assert parse_completion({"prompt": [5, 6]}).prompts == [[5, 6]]


@pytest.mark.parametrize(("body", "param"), [
    ({}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "x"]}, "prompt"),
    ({"prompt": ["x"] * (MAX_PROMPTS + 1)}, "prompt"),
    ({"prompt": "x", "n": 3}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stream": 1}, "stream"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"other": 1}}, "stream_options"),
    ({"prompt": "x", "model": 3}, "model"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "logprobs": 0}, "logprobs"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    ({"prompt": "x", "max_token": 5}, "max_token"),
])
def test_completion_refusals_name_the_parameter(body: dict[str, Any], param: str) -> None:
    err = _refused(parse_completion, body)
    assert (err.status, err.param, err.type) == (400, param, "invalid_request_error")
    assert err.body()["error"]["message"].startswith(param) or "Unrecognized" in err.message


def test_chat_parameters() -> None:
    p = parse_chat({"messages": [{"role": "system", "content": "s"},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]},
                                 {"role": "assistant", "content": None}],
                    "max_completion_tokens": 5, "tool_choice": "none", "response_format": {"type": "text"}})
    assert p.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"},
                          {"role": "assistant", "content": ""}]
    assert p.max_tokens == 5
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}).max_tokens is None


@pytest.mark.parametrize(("body", "param"), [
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 2}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt"),
])
def test_chat_refusals_name_the_parameter(body: dict[str, Any], param: str) -> None:
    assert _refused(parse_chat, body).param == param


@pytest.mark.parametrize(("field", "param", "prefix"), [
    ("sampling.temperature", "temperature", "temperature: "),
    ("sampling.seed", "seed", "seed: "),
    ("prompt_token_ids", "prompt", "prompt: "),
    ("stop[2]", "stop", "stop[2]: "),
    ("max_tokens", "max_tokens", "max_tokens: "),
])
def test_engine_fields_become_openai_parameters(field: str, param: str, prefix: str) -> None:
    err = error_for_invalid(InvalidRequest(field, "is wrong"))
    assert (err.status, err.param, err.message) == (400, param, prefix + "is wrong")
    assert error_for_invalid(InvalidRequest("prompt", "is empty"), prompt_param="messages").param == "messages"
    model = error_for_invalid(InvalidRequest("model", "'x' is not served here"))
    assert (model.status, model.param, model.code) == (404, "model", "model_not_found")


def test_stream_errors_and_finish_reasons() -> None:
    err = error_for_event(StreamEvent(error="the backbone is shutting down", error_kind="unavailable"))
    assert (err.status, err.type, err.code) == (503, "server_error", "unavailable")
    assert error_for_event(StreamEvent(error="boom", error_kind="internal")).status == 500

    def summary(finish: Finish) -> Summary:
        return Summary(finish=finish, stop="", prompt_tokens=3, completion_tokens=2, queue_seconds=0,
                       time_to_first_token_seconds=0, total_seconds=0, tokens_per_second=0, remote_rows=0,
                       local_rows=0, fallback_rows=0, max_batch_size=1, seed=None)

    obj = completion_object("cmpl-1", 0, "m", ["a", "b", "c"],
                            [summary(Finish.LENGTH), summary(Finish.EOS), summary(Finish.STOP)])
    assert [c["finish_reason"] for c in obj["choices"]] == ["length", "stop", "stop"]
    assert obj["usage"] == {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}


def test_chat_template_missing_or_refusing() -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "?": 1}, unk_token="?")))
    err = _refused(lambda m: chat_prompt_ids(tok, m), [{"role": "user", "content": "a"}])
    assert err.param == "messages" and "no chat template" in err.message
    tok.chat_template = "{{ raise_exception('only one user turn') }}"
    err = _refused(lambda m: chat_prompt_ids(tok, m), [{"role": "user", "content": "a"}])
    assert err.param == "messages" and "only one user turn" in err.message
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert chat_prompt_ids(tok, [{"role": "user", "content": "a"}]) == [0]
