"""vLLM's kv_transfer_config as kvserve reads it: every mistake named, nothing ignored."""

from __future__ import annotations

import pytest

from kvserve import LLM
from kvserve.transfer.config import KVTransferConfig

BAD = {
    "not-json": ("{", "not JSON"),
    "list": ("[]", "JSON object"),
    "typo": ({"kv_role": "kv_producer", "kv_prot": 1}, "kv_prot"),
    "connector": ({"kv_role": "kv_producer", "kv_connector": "NixlConnector"}, "NixlConnector"),
    "role": ({"kv_role": "producer"}, "kv_role"),
    "no-peers": ({"kv_role": "kv_consumer"}, "needs peers"),
    "peer": ({"kv_role": "kv_both", "kv_connector_extra_config": {"peers": ["host:1"]}}, "tcp://"),
    "port": ({"kv_role": "kv_producer", "kv_port": 70000}, "kv_port"),
    "extra": ({"kv_role": "kv_producer", "kv_connector_extra_config": {"x": 1}}, "takes"),
    "discover": ({"kv_role": "kv_consumer", "kv_connector_extra_config": {"discover": 1}},
                 "discover must be"),
    "hold-negative": ({"kv_role": "kv_producer",
                       "kv_connector_extra_config": {"hold_seconds": -1}}, "hold_seconds"),
    "hold-too-long": ({"kv_role": "kv_producer",
                       "kv_connector_extra_config": {"hold_seconds": 86400}}, "0 to 3600"),
    "hold-text": ({"kv_role": "kv_producer",
                   "kv_connector_extra_config": {"hold_seconds": "30"}}, "hold_seconds"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_config_is_refused_by_name(case):
    value, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.from_any(value)


def test_roles():
    producer = KVTransferConfig.from_any('{"kv_role": "kv_producer", "kv_port": 15000}')
    assert producer.produces and not producer.consumes
    assert producer.endpoint == "tcp://127.0.0.1:15000"
    both = KVTransferConfig.from_any(
        {"kv_role": "kv_both", "kv_connector_extra_config": {"peers": ["tcp://h:1"]}}
    )
    assert both.produces and both.consumes and both.peers == ("tcp://h:1",)
    # Port 0: the one ZMQ picks; a consumer that discovers its producers names none.
    assert KVTransferConfig.from_any({"kv_role": "kv_producer", "kv_port": 0, "kv_ip": "::1"}
                                     ).endpoint == "tcp://[::1]:*"  # fmt: skip
    told = {"kv_role": "kv_consumer", "kv_connector_extra_config": {"discover": True}}
    assert KVTransferConfig.from_any(told).peers == ()
    # A producer keeps a request's blocks 30 s for its pull unless told otherwise (0: not).
    assert producer.hold_seconds == 30.0
    unkept = {"kv_role": "kv_producer", "kv_connector_extra_config": {"hold_seconds": 0}}
    assert KVTransferConfig.from_any(unkept).hold_seconds == 0.0


def test_a_producer_without_a_cpu_tier_is_refused(checkpoints):
    with pytest.raises(ValueError, match="offload cpu:SIZE"):
        LLM(checkpoints["llama"].path, block_size=4, num_kv_blocks=16, num_threads=1,
            kv_transfer_config={"kv_role": "kv_producer", "kv_port": 15001})  # fmt: skip


def test_the_block_server_answers_hostile_requests_and_goes_on(tmp_path):
    """Nonsense, too many keys, another fingerprint: an error or an empty answer, never a
    crash; a well-formed ask is answered after them."""
    import msgspec
    import zmq

    from kvserve.offload.cpu_tier import CpuTier
    from kvserve.offload.store import TierStack
    from kvserve.transfer.server import MAX_KEYS, BlockServer
    from tests._ports import free_port

    store = TierStack([CpuTier(1 << 20)])
    store.put(b"k", b"payload")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = BlockServer(store, b"fp", endpoint)
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        too_many = msgspec.msgpack.encode(["get", b"fp", [b"k"] * (MAX_KEYS + 1)])
        unknown = msgspec.msgpack.encode(["nope", b"fp", []])
        for bad in (b"\xff\x00garbage", too_many, unknown):
            sock.send(bad)
            assert msgspec.msgpack.decode(sock.recv())[0] == "error"
        sock.send(msgspec.msgpack.encode(["get", b"other", [b"k"]]))
        assert msgspec.msgpack.decode(sock.recv()) == ["fingerprint", None]
        sock.send(msgspec.msgpack.encode(["get", b"fp", [b"k", b"absent", b"k"]]))
        head, *frames = sock.recv_multipart()
        status, checksums = msgspec.msgpack.decode(head)
        assert status == "ok" and checksums[1] is None and frames == [b"payload"] * 2
    finally:
        sock.close()
        server.close()
        store.close()
