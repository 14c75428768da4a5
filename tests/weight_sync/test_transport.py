"""Which transport a fleet gets: 'auto' is shm when every engine is on this host (started by
megarl, or attached at a loopback / own address) and http otherwise; an explicit choice that
cannot reach the engines is a ConfigError naming the field."""

import socket

import pytest

from megarl.config import ConfigError
from megarl.weight_sync.transports import TRANSPORTS, is_local_address, resolve_transport

REMOTE = "192.0.2.7:8100"  # TEST-NET-1: never this host, no DNS lookup needed


def test_is_local_address() -> None:
    assert is_local_address("127.0.0.1:8100") and is_local_address("localhost:1") and is_local_address("127.0.1.1:2")
    assert not is_local_address(REMOTE)
    own = socket.gethostbyname(socket.gethostname())
    assert is_local_address(f"{own}:9000")


@pytest.mark.parametrize(
    ("requested", "addresses", "started_locally", "expected"),
    [
        ("auto", [], True, "shm"),
        ("auto", ["127.0.0.1:1", "localhost:2"], False, "shm"),
        ("auto", ["127.0.0.1:1", REMOTE], False, "http"),
        ("http", ["127.0.0.1:1"], False, "http"),
        ("nccl", [REMOTE], False, "nccl"),
        ("shm", ["127.0.0.1:1"], False, "shm"),
        ("cuda_ipc", [], True, "cuda_ipc"),
    ],
)
def test_resolve_transport(requested: str, addresses: list[str], started_locally: bool, expected: str) -> None:
    assert resolve_transport(requested, addresses, started_locally) == expected


@pytest.mark.parametrize("requested", ["shm", "cuda_ipc"])
def test_host_bound_transports_refuse_remote_engines(requested: str) -> None:
    with pytest.raises(ConfigError, match=rf"weight_sync.transport='{requested}' needs every engine on this host, "
                                          rf"but \['192.0.2.7:8100'\] are not"):
        resolve_transport(requested, ["127.0.0.1:1", REMOTE], started_locally=False)


def test_unknown_transport() -> None:
    with pytest.raises(ConfigError, match=r"weight_sync.transport='gloo' must be one of \['auto', 'shm', 'http'"):
        resolve_transport("gloo", [], True)
    # the config accepts exactly the names the resolver knows: each resolves (to itself, or
    # auto to a concrete one), and a name the resolver refuses is refused by the config too
    from megarl.config import load_config

    for name in TRANSPORTS:
        assert load_config(None, [f"weight_sync.transport={name}"]).weight_sync.transport == name
        got = resolve_transport(name, [], True)
        assert got == name or (name == "auto" and got in TRANSPORTS and got != "auto")
    with pytest.raises(ConfigError, match="weight_sync.transport"):
        load_config(None, ["weight_sync.transport=gloo"])
