"""Token cache: single use, one-minute expiry, bounded size."""

from __future__ import annotations

import pytest

from cri_shim.errors import ResourceExhausted
from cri_shim.streaming.remotecommand import TerminalSizeDecoder, encode_status, exit_code_status
from cri_shim.streaming.tokens import ExecTarget, PortForwardTarget, TokenCache

TARGET = ExecTarget("c1", ("ls",), tty=False, stdin=False, stdout=True, stderr=False)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_is_consumed_once() -> None:
    cache = TokenCache()
    token = cache.insert(TARGET)

    assert cache.consume(token) == TARGET
    assert cache.consume(token) is None


def test_tokens_are_unguessable_and_distinct() -> None:
    cache = TokenCache()
    tokens = {cache.insert(TARGET) for _ in range(100)}

    assert len(tokens) == 100
    assert all(len(token) >= 20 for token in tokens)


def test_token_expires_after_its_ttl() -> None:
    clock = Clock()
    cache = TokenCache(60.0, clock=clock)
    early, late = cache.insert(TARGET), cache.insert(PortForwardTarget("p", (80,)))

    clock.now += 59.9
    assert cache.consume(early) == TARGET
    clock.now += 0.2
    assert cache.consume(late) is None
    assert len(cache) == 0


def test_pending_tokens_are_bounded() -> None:
    cache = TokenCache(max_pending=2)
    cache.insert(TARGET)
    cache.insert(TARGET)

    with pytest.raises(ResourceExhausted):
        cache.insert(TARGET)


def test_terminal_size_decoder_handles_split_and_joined_objects() -> None:
    decoder = TerminalSizeDecoder()

    assert decoder.feed(b'{"Width":80,"Hei') == []
    assert decoder.feed(b'ght":24}{"Width":100,"Height":40}\n') == [(80, 24), (100, 40)]
    assert decoder.feed(b'{"Width":"wide"}') == []


def test_status_encoding_by_protocol_version() -> None:
    status = exit_code_status(2)

    assert encode_status(status, json_status=False) == (
        b"command terminated with non-zero exit code: exit status 2"
    )
    assert b'"causes":[{"reason":"ExitCode","message":"2"}]' in encode_status(
        status, json_status=True
    )
