"""The caches of a registration's layout checks: a valid layout is validated once per value, a
pool/layout/rank match is checked once per combination; bad input is still refused, every
time, and neither cache grows past its bound."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import torch

import protocol.layout as layout_mod
from kvd.config import PoolConfig
from kvd.pool.host import HostMemory
from kvd.pool.pool import Pool
from kvd.transfer import requests as req
from protocol.codec import decode_guarded
from protocol.errors import BadRequest, IncompatibleLayout
from protocol.layout import KVLayout

GEOMETRY = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 8, "tokens_per_block": 4, "dtype": "bfloat16"}


@pytest.fixture(autouse=True)
def _empty_caches() -> Iterator[None]:
    layout_mod._VALID.clear()
    req._MATCHED.clear()
    yield
    layout_mod._VALID.clear()
    req._MATCHED.clear()


def _pool(rank: int = 1, tp: int = 2, num_blocks: int = 8, name: str = "p") -> Pool:
    cfg = PoolConfig(name=name, memory="host", device=-1, rank=rank, tp_size=tp, num_blocks=num_blocks,
                     **GEOMETRY)  # type: ignore[arg-type]
    layout = cfg.layout()
    return Pool(cfg, HostMemory(layout.pool_bytes(rank)))


def test_a_valid_layout_is_validated_once_per_value() -> None:
    a = KVLayout(**GEOMETRY, tp_size=2)  # type: ignore[arg-type]
    assert len(layout_mod._VALID) == 1
    b = msgspec.structs.replace(a, num_blocks=0)  # the same value again: a hit, nothing added
    assert len(layout_mod._VALID) == 1 and a == b
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(a), type=KVLayout)
    assert decoded == a and len(layout_mod._VALID) == 1
    msgspec.structs.replace(a, num_blocks=3)  # another value: validated, then cached
    assert len(layout_mod._VALID) == 2


def test_a_bad_layout_is_refused_every_time_and_never_cached() -> None:
    for _ in range(2):
        with pytest.raises(BadRequest, match="not divisible by tp_size"):
            KVLayout(**{**GEOMETRY, "num_kv_heads": 3}, tp_size=2)  # type: ignore[arg-type]
    assert layout_mod._VALID == {}
    wire = msgspec.msgpack.encode({**GEOMETRY, "tp_size": 3})
    with pytest.raises(BadRequest, match="not divisible by tp_size"):
        decode_guarded(msgspec.msgpack.Decoder(KVLayout), wire, "layout")
    assert layout_mod._VALID == {}


def test_an_equal_value_of_another_type_is_not_taken_for_a_cached_one() -> None:
    KVLayout(**GEOMETRY)  # type: ignore[arg-type]  # head_dim=8 cached
    with pytest.raises(BadRequest, match=r"head_dim must be a positive integer, got 8\.0"):
        KVLayout(**{**GEOMETRY, "head_dim": 8.0})  # type: ignore[arg-type]  # 8.0 == 8, encoded otherwise
    with pytest.raises(BadRequest, match="head_dim must be a positive integer"):
        KVLayout(**{**GEOMETRY, "head_dim": object()})  # type: ignore[arg-type]  # not even encodable
    assert len(layout_mod._VALID) == 1


def test_the_validation_cache_is_bounded() -> None:
    for n in range(layout_mod.VALID_CACHE_SIZE * 2 + 3):
        KVLayout(**GEOMETRY, num_blocks=n)  # type: ignore[arg-type]
        assert len(layout_mod._VALID) <= layout_mod.VALID_CACHE_SIZE
    KVLayout(**GEOMETRY, num_blocks=1)  # type: ignore[arg-type]  # still validated and served
    assert len(layout_mod._VALID) <= layout_mod.VALID_CACHE_SIZE


def test_a_pool_match_is_checked_once_and_answers_as_the_check() -> None:
    pool = _pool()
    layout = KVLayout(**GEOMETRY, tp_size=2)  # type: ignore[arg-type]
    first = req.check_pool_matches(pool, layout, 1)
    assert first.num_blocks == 8 and len(req._MATCHED) == 1
    assert req.check_pool_matches(pool, layout, 1) is first  # a hit
    assert req.check_pool_matches(pool, msgspec.structs.replace(layout, num_blocks=8), 1).num_blocks == 8
    assert len(req._MATCHED) == 2
    pool.close()


def test_a_mismatch_is_refused_every_time_and_never_cached() -> None:
    pool = _pool()
    good = KVLayout(**GEOMETRY, tp_size=2)  # type: ignore[arg-type]
    req.check_pool_matches(pool, good, 1)
    for _ in range(2):
        with pytest.raises(BadRequest, match="configured as rank 1"):
            req.check_pool_matches(pool, good, 0)
        with pytest.raises(IncompatibleLayout, match="holds shape"):
            req.check_pool_matches(pool, msgspec.structs.replace(good, head_dim=16), 1)
        with pytest.raises(IncompatibleLayout, match="num_blocks=9"):
            req.check_pool_matches(pool, msgspec.structs.replace(good, num_blocks=9), 1)
        with pytest.raises(BadRequest, match="outside the layout's world size"):
            req.check_pool_matches(pool, good, 2)
    assert len(req._MATCHED) == 1
    # the same layout against another pool (other rank, other shape) is checked on its own
    other = _pool(rank=1, tp=4)
    with pytest.raises(IncompatibleLayout, match="holds shape"):
        req.check_pool_matches(other, good, 1)
    pool.close()
    other.close()


def test_the_match_cache_is_bounded() -> None:
    layout = KVLayout(**GEOMETRY, tp_size=2)  # type: ignore[arg-type]
    for n in range(req.MATCHED_CACHE_SIZE * 2 + 3):  # as many pools, each a distinct key
        pool = _pool(name=f"p{n}")
        assert req.check_pool_matches(pool, layout, 1).num_blocks == 8
        assert len(req._MATCHED) <= req.MATCHED_CACHE_SIZE
        pool.close()


def test_a_layout_that_cannot_be_hashed_is_checked_without_the_cache() -> None:
    """A layout built in Python with a list (decoded ones hold tuples) is checked as always."""
    pool = _pool()
    listed = KVLayout(**GEOMETRY, tp_size=2, layer_split=[2])  # type: ignore[arg-type]
    assert req.check_pool_matches(pool, listed, 1).num_blocks == 8
    with pytest.raises(BadRequest, match="configured as rank 1"):
        req.check_pool_matches(pool, listed, 0)
    assert req._MATCHED == {}
    pool.close()


def test_a_torch_dtype_is_refused_naming_the_string_to_give() -> None:
    """``dtype=torch.bfloat16`` (an easy slip in an executor) is refused with the name to pass
    instead; the protocol carries dtype names, not torch objects."""
    with pytest.raises(BadRequest, match=r"dtype must be a dtype's name, one of \[.*\] \(here 'bfloat16'\), "
                                         r"not dtype torch\.bfloat16"):
        KVLayout(**{**GEOMETRY, "dtype": torch.bfloat16})  # type: ignore[arg-type]
    with pytest.raises(BadRequest, match=r"not int 3$"):
        KVLayout(**{**GEOMETRY, "dtype": 3})  # type: ignore[arg-type]
    assert layout_mod._VALID == {}
