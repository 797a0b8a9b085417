"""The service's intake rules, without a server (``backbone serve``'s bounds; the real
processes are in tests/test_serve_intake.py): a prompt's size is checked in UTF-8 bytes
before the tokenizer runs, a body with a lone surrogate is refused naming where it is, a
gRPC request whose strings are not UTF-8 is told apart from grpcio's INTERNAL, and an
address beyond loopback needs an API key unless --no-auth."""

from __future__ import annotations

import json
import types
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backbone.cli._serve import auth_refusal
from backbone.engine._batch import InvalidRequest, Sampling
from backbone.service._grpc_api import (
    GRPC_DEFAULT_MESSAGE_BYTES,
    PROMPT_BYTES_CAP,
    PROMPT_BYTES_PER_TOKEN,
    Backbone,
    Undecodable,
    decode_request,
    default_max_prompt_bytes,
    max_message_bytes,
)
from backbone.service._http_api import MAX_BODY_BYTES, _Api, max_body_bytes
from backbone.service._openai_shapes import ApiError, parse_chat, parse_completion
from kvasir_rpc import backbone_pb2

CONTEXT = 2048


class _Tokenizer:
    """Counts what it is asked to tokenize; a chat template that renders every message."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, text: str) -> dict[str, list[int]]:
        self.calls += 1
        return {"input_ids": [1] * max(1, len(text) // 4)}

    def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> list[int]:
        self.calls += 1
        return [1] * 8


def _backbone(max_prompt_bytes: int = 0) -> tuple[Backbone, _Tokenizer]:
    tokenizer = _Tokenizer()
    engine: Any = types.SimpleNamespace(context_length=CONTEXT, max_tokens_cap=CONTEXT,
                                        validate=lambda request: None)
    dispatcher: Any = types.SimpleNamespace(observe_call=None)
    return Backbone(engine=engine, tokenizer=tokenizer, dispatcher=dispatcher, model_id="tiny",
                    max_prompt_bytes=max_prompt_bytes), tokenizer


# -- the limits ------------------------------------------------------------------------------

def test_the_default_prompt_limit_follows_the_context_up_to_a_cap() -> None:
    assert default_max_prompt_bytes(CONTEXT) == PROMPT_BYTES_PER_TOKEN * CONTEXT
    assert default_max_prompt_bytes(1 << 20) == PROMPT_BYTES_CAP
    assert _backbone()[0].max_prompt_bytes == PROMPT_BYTES_PER_TOKEN * CONTEXT
    assert _backbone(100)[0].max_prompt_bytes == 100


def test_grpc_reads_every_valid_request_and_up_to_its_usual_limit_and_the_http_body_holds_a_prompt() -> None:
    assert max_message_bytes(default_max_prompt_bytes(CONTEXT), CONTEXT) == GRPC_DEFAULT_MESSAGE_BYTES
    # A whole context of the largest token ids with the largest prompt text still fits.
    big = backbone_pb2.GenerateRequest(prompt="é" * (PROMPT_BYTES_CAP // 2), prompt_token_ids=[2**32 - 1] * 262144,
                                       stop=["s" * 256] * 8, model="m" * 200, max_tokens=2**32 - 1,
                                       sampling=backbone_pb2.Sampling(temperature=1, top_p=1, top_k=1, seed=2**64 - 1))
    assert big.ByteSize() <= max_message_bytes(PROMPT_BYTES_CAP, 262144)
    assert max_message_bytes(64 << 20, CONTEXT) > 64 << 20
    assert max_body_bytes(1000) == MAX_BODY_BYTES
    assert max_body_bytes(1 << 20) == 4 << 20


# -- a prompt's size before its tokens ---------------------------------------------------------

@pytest.mark.parametrize("prompt, over", [
    ("x" * 100, False),
    ("x" * 101, True),
    ("é" * 50, False),  # 100 bytes
    ("é" * 50 + "x", True),
    ("\U0001F600" * 25, False),  # 100 bytes
    ("\U0001F600" * 25 + "x", True),
], ids=["ascii-at", "ascii-over", "2-byte-at", "2-byte-over", "4-byte-at", "4-byte-over"])
def test_a_prompt_is_measured_in_utf8_bytes_and_refused_before_the_tokenizer_runs(prompt: str, over: bool) -> None:
    bb, tokenizer = _backbone(100)
    if not over:
        bb.request(prompt=prompt, prompt_ids=None, max_tokens=1, sampling=Sampling())
        assert tokenizer.calls == 1
        return
    with pytest.raises(InvalidRequest) as refused:
        bb.request(prompt=prompt, prompt_ids=None, max_tokens=1, sampling=Sampling())
    size = len(prompt.encode())
    assert str(refused.value).startswith(f"prompt: {size} bytes of UTF-8 text, more than this backbone's limit of "
                                         "100 bytes")
    assert "--max-prompt-bytes" in str(refused.value)
    assert tokenizer.calls == 0


def test_http_checks_every_prompt_and_the_chat_messages_together_before_tokenizing() -> None:
    bb, tokenizer = _backbone(100)
    api = _Api(bb, timeout_s=1.0)
    with pytest.raises(ApiError) as refused:
        api._completion_requests(parse_completion({"prompt": ["short", "y" * 101], "max_tokens": 1}))
    assert (refused.value.status, refused.value.param) == (400, "prompt")
    assert refused.value.message.startswith("prompt[1]: 101 bytes of UTF-8 text")
    with pytest.raises(ApiError) as alone:
        api._completion_requests(parse_completion({"prompt": "y" * 101, "max_tokens": 1}))
    assert alone.value.message.startswith("prompt: 101 bytes")
    # Two messages of 60 bytes: each is under the limit, together they are over it.
    messages = [{"role": "system", "content": "s" * 60}, {"role": "user", "content": "u" * 60}]
    with pytest.raises(ApiError) as chat:
        api._chat_requests(parse_chat({"messages": messages}))
    assert (chat.value.status, chat.value.param) == (400, "messages")
    assert chat.value.message.startswith("messages: 120 bytes of UTF-8 text")
    assert tokenizer.calls == 0
    assert len(api._chat_requests(parse_chat({"messages": messages[:1]}))) == 1
    assert tokenizer.calls == 1


# -- text that is no Unicode -------------------------------------------------------------------

@pytest.mark.parametrize("raw, parse, param", [
    (b'{"prompt": "\\ud800"}', parse_completion, "prompt"),
    (b'{"prompt": "ok \\udfff then"}', parse_completion, "prompt"),
    (b'{"prompt": ["fine", "\\ud83d"]}', parse_completion, "prompt[1]"),
    (b'{"prompt": "\xed\xa0\x80"}', parse_completion, "prompt"),  # a surrogate's UTF-8 bytes
    (b'{"prompt": "hi", "stop": "\\ud800"}', parse_completion, "stop"),
    (b'{"prompt": "hi", "stop": ["a", "\\ud800"]}', parse_completion, "stop[1]"),
    (b'{"prompt": "hi", "model": "\\ud800"}', parse_completion, "model"),
    (b'{"prompt": "hi", "\\ud800": 1}', parse_completion, None),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', parse_chat, "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', parse_chat,
     "messages[0].content[0].text"),
    (b'{"messages": [{"role": "\\ud800", "content": "hi"}]}', parse_chat, "messages[0].role"),
], ids=["prompt", "low-alone", "prompt-list", "raw-bytes", "stop", "stop-list", "model", "key", "chat", "chat-part",
        "role"])
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(raw: bytes, parse: Any, param: str | None) -> None:
    with pytest.raises(ApiError) as refused:
        parse(json.loads(raw))
    err = refused.value
    assert (err.status, err.param, err.type) == (400, param, "invalid_request_error")
    assert "lone UTF-16 surrogate" in err.message and "\\ud800-\\udbff" in err.message
    if param is not None:
        assert err.message.startswith(f"{param}: ")
    # The error itself can be sent: it is valid UTF-8 JSON.
    json.dumps(err.body(), ensure_ascii=False).encode()


def test_a_surrogate_pair_is_one_character_and_passes() -> None:
    params = parse_completion(json.loads(b'{"prompt": "smile \\ud83d\\ude00", "stop": "\\ud83d\\ude00"}'))
    assert params.prompts == ["smile \U0001F600"] and params.stop == ("\U0001F600",)


# Any character, lone surrogates often (hypothesis draws them rarely on its own).
_json_text = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF) | st.sampled_from(
    ["\ud800", "\udbff", "\udc00", "\udfff"]), max_size=8)
_json = st.recursive(st.none() | st.booleans() | st.integers() | _json_text,
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_json_text, inner, max_size=4),
                     max_leaves=12)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(body=st.dictionaries(st.sampled_from(["prompt", "messages", "stop", "model", "max_tokens", "user"]) | _json_text,
                            _json, max_size=4),
       chat=st.booleans())
def test_any_decoded_body_parses_or_gets_an_api_error_that_can_be_sent(body: dict[str, Any], chat: bool) -> None:
    try:
        (parse_chat if chat else parse_completion)(body)
    except ApiError as err:
        json.dumps(err.body(), ensure_ascii=False).encode()
    else:
        json.dumps(body, ensure_ascii=False).encode()  # what parsed holds no lone surrogate


# -- gRPC requests that do not parse ------------------------------------------------------------

def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited field in protobuf wire format."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


@pytest.mark.parametrize("cls, data, starts", [
    (backbone_pb2.GenerateRequest, _field(2, b"\xed\xa0\x80"), "prompt: is not UTF-8 (byte 0"),
    (backbone_pb2.GenerateRequest, _field(2, b"ok\xff"), "prompt: is not UTF-8 (byte 2"),
    (backbone_pb2.GenerateRequest, _field(2, b"ok") + _field(6, b"a") + _field(6, b"\xc3"), "stop[1]: is not UTF-8"),
    (backbone_pb2.GenerateRequest, _field(1, b"\xed\xb0\x80"), "model: is not UTF-8"),
    (backbone_pb2.BackboneServiceDescribeRequest, _field(1, b"\xff"), "model: is not UTF-8"),
    (backbone_pb2.GenerateRequest, b"\xff\xff\xff", "the request is not a kvasir.v1.GenerateRequest: its bytes"),
    (backbone_pb2.GenerateRequest, _field(5, b"\x0a\xff"), "the request is not a valid kvasir.v1.GenerateRequest"),
], ids=["surrogate", "invalid", "stop", "model", "describe", "garbage", "nested"])
def test_a_request_that_does_not_parse_says_which_field_and_why(cls: Any, data: bytes, starts: str) -> None:
    got = decode_request(cls, data)
    assert isinstance(got, Undecodable)
    assert got.reason.startswith(starts), got.reason


def test_every_truncation_of_a_request_parses_or_is_undecodable_never_raises() -> None:
    good = backbone_pb2.GenerateRequest(prompt="héllo", stop=["a", "b"], prompt_token_ids=[1, 300, 70000],
                                        sampling=backbone_pb2.Sampling(temperature=0.5, seed=7)).SerializeToString()
    assert decode_request(backbone_pb2.GenerateRequest, good) == backbone_pb2.GenerateRequest.FromString(good)
    bad = good + _field(6, b"\xed\xa0\x80")
    for data in (good, bad):
        for end in range(len(data) + 1):
            got = decode_request(backbone_pb2.GenerateRequest, data[:end])
            assert isinstance(got, (backbone_pb2.GenerateRequest, Undecodable))
    assert decode_request(backbone_pb2.GenerateRequest, bad) == Undecodable(
        "stop[2]: is not UTF-8 (byte 0: invalid continuation byte); protobuf strings must be valid UTF-8, and a "
        "lone UTF-16 surrogate (such as U+D800) is no character: send the text encoded as UTF-8")


# -- who may call -------------------------------------------------------------------------------

@pytest.mark.parametrize("listen, http, key, no_auth, refused", [
    ("127.0.0.1:50061", None, False, False, None),
    ("127.0.0.1:50061", "127.0.0.1:8000", False, False, None),
    ("localhost:0", "[::1]:8000", False, False, None),
    ("[::ffff:127.0.0.1]:0", None, False, False, None),
    ("0.0.0.0:50061", None, False, False, "--listen 0.0.0.0:50061 is beyond loopback"),
    (":50061", None, False, False, "--listen :50061 is beyond loopback"),
    ("[::]:50061", None, False, False, "--listen [::]:50061 is beyond loopback"),
    ("192.168.1.5:50061", None, False, False, "--listen 192.168.1.5:50061"),
    ("backbone.example:50061", None, False, False, "--listen backbone.example:50061"),
    ("127.0.0.1:50061", "0.0.0.0:8000", False, False, "--http 0.0.0.0:8000 is beyond loopback"),
    ("0.0.0.0:50061", "0.0.0.0:8000", True, False, None),
    ("0.0.0.0:50061", "0.0.0.0:8000", False, True, None),
    ("127.0.0.1:50061", None, True, True, "--no-auth and --api-key-file contradict each other"),
], ids=["default", "both-loopback", "localhost-v6", "mapped", "any-v4", "empty-host", "any-v6", "lan", "name",
        "http", "key", "no-auth", "both-flags"])
def test_beyond_loopback_needs_a_key_or_no_auth(listen: str, http: str | None, key: bool, no_auth: bool,
                                                refused: str | None) -> None:
    why = auth_refusal(listen, http, api_key_file=key, no_auth=no_auth)
    if refused is None:
        assert why is None
        return
    assert why is not None and why.startswith(refused) and "\n" not in why
    if "contradict" not in why:
        assert "--api-key-file FILE" in why and "--no-auth" in why
