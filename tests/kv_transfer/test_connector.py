"""The KV connector's control messages and head split: one JSON codec (no pickle) that gives
back what it was given, and a follower's failure raised on rank 0 as the same kind."""

from __future__ import annotations

import pytest

from pdmesh.kv_transfer import TransferError
from pdmesh.kv_transfer.connector import Count, Failed, KVHeads, decode, encode, raise_failures
from pdmesh.kv_transfer.push_connector import PushStart
from pdmesh.kv_transfer.receive_connector import RankEndpoints, ReceiveOptions
from pdmesh.kv_transfer.target import KVEndpoint, KVTarget


def test_messages_survive_the_codec() -> None:
    endpoint = KVEndpoint("tcp://10.0.0.1:5000", 2, 2)
    target = KVTarget("tcp", "ab" * 16, bytes(range(16)), 1, (7, 3), 16, (endpoint,), 2.5, {})
    messages = [
        PushStart(4, target),
        ReceiveOptions(("auto", "tcp"), "tcp://127.0.0.1:0", "10.0.0.2", {"p:1": "tcp"}),
        RankEndpoints({"tcp": endpoint}),
        Count(12345),
        None,
    ]
    for message in messages:
        data = encode(message)
        assert b"pickle" not in data
        assert decode(data) == message


def test_unknown_messages_are_refused() -> None:
    with pytest.raises(TypeError):
        encode(object())
    with pytest.raises(ValueError, match="unknown control message"):
        decode(b'{"type": "Nope", "fields": {}}')


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (TransferError("gone"), TransferError),
        (ValueError("bad"), ValueError),
        (KeyError(1), RuntimeError),
    ],
)
def test_a_follower_failure_is_raised_on_rank_0(error: Exception, kind: type) -> None:
    replies = [Count(1), decode(encode(Failed.of(error)))]
    with pytest.raises(kind, match="tensor-parallel rank 2"):
        raise_failures(replies)
    assert raise_failures([Count(1), None]) == [Count(1), None]


@pytest.mark.parametrize(("total", "size"), [(3, 1), (3, 3), (2, 4), (8, 2), (1, 4)])
def test_kv_heads_cover_every_head_once_per_replica(total: int, size: int) -> None:
    heads = [KVHeads.of_rank(total, rank, size) for rank in range(size)]
    senders = [h for h in heads if h.sends]
    covered = sorted(i for h in senders for i in range(h.start, h.start + h.count))
    assert covered == list(range(total))  # each head pushed by exactly one rank
    assert all(h.start >= 0 and h.start + h.count <= total for h in heads)
