"""The pool memory policy on a CPU machine: every combination of memory kind x require_fabric x
the two environment variables x (host pool, GPU pool).

On this machine there is no CUDA driver, so a GPU pool's fabric probe fails ("no CUDA driver")
and the fallback path is the one exercised for real: the ``pool.fabric_unavailable`` warning,
then a ``PoolError`` from the fallback kind. Fakes stand in for a GPU to test the paths where
fabric works or the probe fails with a CUDA error and the fallback succeeds.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import structlog
import torch
from structlog.testing import capture_logs

from kvd.config import PoolConfig
from kvd.pool import (
    ENV_VARS,
    Decision,
    ExportedHandle,
    HostMemory,
    MemoryKind,
    Pool,
    PoolMemory,
    choose_and_create,
    create_pools,
    decide,
    env_fabric_setting,
    probe_fabric,
)
from protocol.errors import BadRequest, FabricUnavailable, PoolError

KVD, TRT = ENV_VARS
MEMORIES = ("auto", "fabric", "device", "posix_fd", "host")
ENV_VALUES = (None, "0", "1")

if torch.cuda.is_available():  # pragma: no cover - these tests describe a CPU machine
    pytest.skip("the CPU policy tests expect a machine without CUDA", allow_module_level=True)


def cfg_for(
    memory: str = "auto", *, device: int = -1, require_fabric: bool = False, name: str = "p"
) -> PoolConfig:
    return PoolConfig(
        name=name,
        memory=memory,  # type: ignore[arg-type]
        require_fabric=require_fabric,
        device=device,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        tokens_per_block=4,
        dtype="bfloat16",
        num_blocks=16,
    )


def env_for(kvd: str | None, trt: str | None) -> dict[str, str]:
    env = {"UNRELATED": "1"}
    if kvd is not None:
        env[KVD] = kvd
    if trt is not None:
        env[TRT] = trt
    return env


# --- the specification, written out independently of kvd.pool.policy -----------------------


@dataclass(frozen=True)
class Expect:
    error: tuple[type[Exception], str] | None = None  # decide() refuses
    try_fabric: bool = False
    kind: str = "host"  # kind created when fabric is not used
    required: bool = False
    events: tuple[str, ...] = ()  # events logged by the decision


def spec(memory: str, require: bool, kvd: str | None, trt: str | None, device: int) -> Expect:
    set_values = {v for v in (kvd, trt) if v is not None}
    if len(set_values) == 2:
        return Expect(error=(BadRequest, f"{KVD}={kvd} and {TRT}={trt} disagree"))
    use = None if not set_values else set_values.pop() == "1"
    gpu = device >= 0
    if require and not gpu:
        return Expect(error=(BadRequest, "require_fabric=true needs a GPU pool"))
    if require and memory not in ("auto", "fabric"):
        return Expect(error=(BadRequest, f"require_fabric=true contradicts memory='{memory}'"))
    if require and use is False:
        return Expect(error=(BadRequest, r"require_fabric=true contradicts .*_USE_FABRIC_MEMORY=0"))
    if not gpu and memory in ("fabric", "device", "posix_fd"):
        return Expect(error=(BadRequest, f"memory='{memory}' needs a GPU"))
    if not gpu or memory == "host":
        events: tuple[str, ...] = ("pool.host_memory_on_gpu_config",) if gpu else ()
        if use:
            events += ("pool.fabric_not_applicable",)
        return Expect(kind="host", events=events)
    wants_fabric = memory in ("auto", "fabric")
    kind = "device" if wants_fabric else memory
    if use is None:
        return Expect(try_fabric=wants_fabric, kind=kind, required=require)
    if use:
        events = () if wants_fabric else ("pool.fabric_enabled_by_env",)
        return Expect(try_fabric=True, kind=kind, required=require, events=events)
    events = ("pool.fabric_disabled",) if wants_fabric else ()
    return Expect(try_fabric=False, kind=kind, events=events)


COMBOS = list(itertools.product(MEMORIES, (False, True), ENV_VALUES, ENV_VALUES, (-1, 0)))


def combo_id(c: tuple[Any, ...]) -> str:
    memory, req, kvd, trt, dev = c
    return f"{memory}-req{int(req)}-kvd{kvd or 'unset'}-trt{trt or 'unset'}-dev{dev}"


@pytest.mark.parametrize("combo", COMBOS, ids=[combo_id(c) for c in COMBOS])
def test_every_combination_on_cpu(combo: tuple[str, bool, str | None, str | None, int]) -> None:
    memory, req, kvd, trt, dev = combo
    cfg = cfg_for(memory, device=dev, require_fabric=req)
    env = env_for(kvd, trt)
    exp = spec(memory, req, kvd, trt, dev)

    # 1. the pure decision
    if exp.error is not None:
        cls, pattern = exp.error
        with pytest.raises(cls, match=pattern):
            decide(cfg, env)
        with capture_logs() as logs, pytest.raises(cls, match=pattern):
            choose_and_create(cfg, env)
        assert logs == []  # nothing was tried, nothing logged
        return
    d = decide(cfg, env)
    assert d.try_fabric is exp.try_fabric
    assert d.fallback_kind == (None if exp.required else exp.kind)
    assert tuple(n.event for n in d.notes) == exp.events
    if kvd is not None or trt is not None:
        assert d.source and all(f"{var}=" in d.source for var, v in ((KVD, kvd), (TRT, trt)) if v is not None)

    # 2. the real outcome on this CPU machine
    with capture_logs() as logs:
        if exp.kind == "host" and not exp.try_fabric:
            mem, reason = choose_and_create(cfg, env)
            try:
                assert isinstance(mem, HostMemory)
                assert mem.kind == "host" and mem.device == -1
                assert mem.nbytes == cfg.layout().pool_bytes(0)
            finally:
                mem.close()
            if "pool.fabric_not_applicable" in exp.events:
                assert "does not apply to host memory" in reason
            else:
                assert reason == ""
            outcome = None
        else:
            with pytest.raises(PoolError) as info:
                choose_and_create(cfg, env)
            outcome = info.value
    events = [e["event"] for e in logs]
    for ev in exp.events:
        assert ev in events
    unavailable = [e for e in logs if e["event"] == "pool.fabric_unavailable"]
    if outcome is None:
        assert unavailable == []
        assert events[-1] == "pool.created"
        return
    assert "no CUDA driver" in outcome.message
    if exp.try_fabric and exp.required:
        assert type(outcome) is FabricUnavailable
        assert re.search(
            r"pool 'p': fabric memory is required \(require_fabric\) but unavailable on GPU 0",
            outcome.message,
        )
        assert unavailable == []
    elif exp.try_fabric:
        assert type(outcome) is PoolError
        assert len(unavailable) == 1
        warn = unavailable[0]
        assert warn["log_level"] == "warning"
        assert warn["kind"] == exp.kind
        assert warn["pool"] == "p" and warn["device"] == 0
        assert "no CUDA driver" in warn["error"]
        assert f"pool 'p': cannot create {exp.kind} memory on GPU 0: no CUDA driver" in outcome.message
    else:
        assert type(outcome) is PoolError
        assert unavailable == []
        assert f"pool 'p': cannot create {exp.kind} memory on GPU 0: no CUDA driver" in outcome.message
    slow = [e for e in logs if e["event"] == "pool.posix_fd_slow_nixl_target"]
    assert len(slow) == (1 if exp.kind == "posix_fd" and not exp.required else 0)


def test_fabric_disabled_is_info_for_auto_and_warning_for_explicit_fabric() -> None:
    for memory, level in (("auto", "info"), ("fabric", "warning")):
        with capture_logs() as logs, pytest.raises(PoolError):
            choose_and_create(cfg_for(memory, device=0), {TRT: "0"})
        (note,) = [e for e in logs if e["event"] == "pool.fabric_disabled"]
        assert note["log_level"] == level
        assert note["variable"] == f"{TRT}=0"
        assert note["kind"] == "device"
        assert not [e for e in logs if e["event"] == "pool.fabric_unavailable"]


def test_no_driver_probe_reports_the_cause() -> None:
    error = probe_fabric(0)
    assert error is not None and error.startswith("no CUDA driver")


# --- environment parsing -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({KVD: ""}, None),
        ({KVD: " 1 "}, True),
        ({TRT: "0"}, False),
        ({KVD: "true", TRT: "1"}, True),
        ({KVD: "off", TRT: "0"}, False),
        ({KVD: "Yes"}, True),
    ],
)
def test_env_setting(env: dict[str, str], expected: bool | None) -> None:
    value, source = env_fabric_setting(env)
    assert value is expected
    assert (source == "") is (expected is None)


@pytest.mark.parametrize("raw", ["2", "maybe", "-1"])
def test_env_invalid_value(raw: str) -> None:
    with pytest.raises(BadRequest, match=rf"environment {KVD}='{raw}': expected 1 .* or 0"):
        env_fabric_setting({KVD: raw})


def test_env_disagreement_names_both() -> None:
    with pytest.raises(BadRequest, match=rf"{KVD}=1 and {TRT}=0 disagree"):
        decide(cfg_for("auto", device=0), {KVD: "1", TRT: "0"})


def test_default_env_is_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KVD, "1")
    monkeypatch.delenv(TRT, raising=False)
    with capture_logs() as logs:
        mem, reason = choose_and_create(cfg_for("auto"))
    mem.close()
    assert "does not apply to host memory" in reason
    assert [e["event"] for e in logs] == ["pool.fabric_not_applicable", "pool.created"]


def test_decision_is_data() -> None:
    d = decide(cfg_for("auto", device=3), {})
    assert d == Decision(try_fabric=True, fallback_kind="device", reason="", source="", notes=())


# --- with a fake GPU: the paths a CPU machine cannot reach for real ------------------------


class FakeGpuMemory(PoolMemory):
    """Host memory posing as a GPU kind (records what was asked for)."""

    def __init__(self, kind: MemoryKind, nbytes: int, device: int) -> None:
        self._host = HostMemory(nbytes)
        self.kind = kind
        self.device = device
        self.nbytes = nbytes
        self.map_bytes = nbytes
        self.ptr = self._host.ptr

    @property
    def closed(self) -> bool:
        return self._host.closed

    def tensor(self) -> torch.Tensor:
        return self._host.tensor()

    def export(self) -> ExportedHandle:
        return ExportedHandle(handle_kind="fabric", handle=b"\x01" * 64)

    def close(self) -> None:
        self._host.close()


class FakeGpu:
    def __init__(self, probe_error: str | None = None, fail: dict[str, str] | None = None) -> None:
        self.probe_error = probe_error
        self.fail = fail or {}
        self.calls: list[str] = []

    def probe(self, device: int) -> str | None:
        self.calls.append(f"probe:{device}")
        return self.probe_error

    def create(self, kind: MemoryKind, nbytes: int, device: int, name: str) -> PoolMemory:
        self.calls.append(f"create:{kind}")
        if kind in self.fail:
            raise PoolError(self.fail[kind])
        return FakeGpuMemory(kind, nbytes, device)


def test_fabric_works() -> None:
    gpu = FakeGpu()
    with capture_logs() as logs:
        mem, reason = choose_and_create(cfg_for("auto", device=0), {}, create=gpu.create, probe=gpu.probe)
    assert (mem.kind, reason) == ("fabric", "")
    assert gpu.calls == ["probe:0", "create:fabric"]
    assert [e["event"] for e in logs] == ["pool.created"]
    mem.close()


def test_fabric_not_permitted_falls_back_to_device_with_warning() -> None:
    gpu = FakeGpu(probe_error="cuMemCreate: CUDA_ERROR_NOT_PERMITTED")
    with capture_logs() as logs:
        mem, reason = choose_and_create(
            cfg_for("auto", device=1, name="kv"), {}, create=gpu.create, probe=gpu.probe
        )
    assert mem.kind == "device"
    assert reason == "fabric memory unavailable: cuMemCreate: CUDA_ERROR_NOT_PERMITTED"
    assert gpu.calls == ["probe:1", "create:device"]
    warn = logs[0]
    assert warn == {
        "event": "pool.fabric_unavailable",
        "log_level": "warning",
        "pool": "kv",
        "device": 1,
        "error": "cuMemCreate: CUDA_ERROR_NOT_PERMITTED",
        "kind": "device",
    }
    assert logs[1]["event"] == "pool.created" and logs[1]["fallback_reason"] == reason
    mem.close()


def test_full_size_fabric_allocation_failure_falls_back() -> None:
    gpu = FakeGpu(fail={"fabric": "cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY"})
    with capture_logs() as logs:
        mem, reason = choose_and_create(cfg_for("fabric", device=0), {}, create=gpu.create, probe=gpu.probe)
    assert mem.kind == "device"
    assert "CUDA_ERROR_OUT_OF_MEMORY" in reason
    assert logs[0]["event"] == "pool.fabric_unavailable" and logs[0]["error"].endswith("OUT_OF_MEMORY")
    mem.close()


def test_require_fabric_refuses_to_fall_back() -> None:
    gpu = FakeGpu(probe_error="cuMemCreate: CUDA_ERROR_NOT_PERMITTED")
    with pytest.raises(FabricUnavailable, match=r"require_fabric.*CUDA_ERROR_NOT_PERMITTED") as info:
        choose_and_create(
            cfg_for("auto", device=0, require_fabric=True), {}, create=gpu.create, probe=gpu.probe
        )
    assert info.value.code == "fabric_unavailable"
    assert gpu.calls == ["probe:0"]


def test_env_one_tries_fabric_before_posix_fd() -> None:
    gpu = FakeGpu(probe_error="cuMemCreate: CUDA_ERROR_NOT_PERMITTED")
    with capture_logs() as logs:
        mem, _ = choose_and_create(
            cfg_for("posix_fd", device=0), {KVD: "1"}, create=gpu.create, probe=gpu.probe
        )
    assert mem.kind == "posix_fd"
    assert [e["event"] for e in logs] == [
        "pool.fabric_enabled_by_env",
        "pool.fabric_unavailable",
        "pool.posix_fd_slow_nixl_target",
        "pool.created",
    ]
    mem.close()


def test_env_zero_skips_the_probe() -> None:
    gpu = FakeGpu()
    mem, reason = choose_and_create(cfg_for("auto", device=0), {KVD: "0"}, create=gpu.create, probe=gpu.probe)
    assert gpu.calls == ["create:device"]
    assert reason == f"fabric memory disabled by {KVD}=0"
    mem.close()


# --- Pool on host memory -------------------------------------------------------------------


def test_host_pool_info_attach_and_tensor() -> None:
    cfg = cfg_for("auto", name="cpu0")
    pool = Pool.create(cfg, {})
    try:
        layout = cfg.layout()
        t = pool.tensor()
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == layout.pool_shape(0)
        assert t.data_ptr() == pool.memory.ptr == pool.ptr
        assert pool.nbytes == pool.map_bytes == layout.pool_bytes(0)
        u8 = pool.tensor_u8()
        assert u8.dtype == torch.uint8 and u8.numel() == pool.nbytes and u8.data_ptr() == pool.ptr
        ids = pool.blocks.alloc(7, 3)
        info = pool.info()
        assert (info.name, info.kind, info.device, info.fallback_reason) == ("cpu0", "host", -1, "")
        assert (info.num_blocks, info.blocks_used, info.blocks_free, info.sessions) == (16, 3, 13, 1)
        assert info.block_bytes == layout.block_bytes(0) and info.pool_bytes == layout.pool_bytes(0)
        assert info.shape == layout.pool_shape(0) and info.axis_order == layout.axis_order
        assert info.layout == layout and info.dtype == "bfloat16" and info.rank == 0
        assert pool.info(sessions=5).sessions == 5
        reply, fds = pool.attach_reply(42)
        assert (reply.id, reply.handle_kind, reply.map_bytes, reply.pool) == (
            42,
            "fd",
            info.pool_bytes,
            pool.info(),
        )
        assert len(fds) == 1 and os.fstat(fds[0]).st_size == info.pool_bytes
        # the reply crosses the wire unchanged
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=type(reply)) == reply
        # writes through the typed view land in the raw bytes
        t[ids[0]].fill_(1.0)
        raw = pool.memory.tensor()
        first = ids[0] * info.block_bytes
        assert raw[first : first + 2].tolist() == [0x80, 0x3F]  # bf16 1.0, little-endian
    finally:
        pool.close()
        pool.close()  # idempotent
    with pytest.raises(PoolError, match="closed"):
        pool.memory.export()


def test_host_memory_close_keeps_live_views_safe() -> None:
    mem = HostMemory(4096, name="x")
    view = mem.tensor()[:16]
    mem.close()
    assert mem.closed
    view.fill_(3)  # still mapped: released with the last view, never a dangling pointer
    assert int(view.sum()) == 48
    mem.close()


def test_host_memfd_is_sealed() -> None:
    mem = HostMemory(8192)
    try:
        (fd,) = mem.export().fds
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1 << 20)
    finally:
        mem.close()


def test_create_pools_closes_earlier_pools_on_failure() -> None:
    good = cfg_for("host", name="a")
    bad = cfg_for("device", device=0, name="b")
    with (
        structlog.testing.capture_logs(),
        pytest.raises(PoolError, match="pool 'b': cannot create device memory") as info,
    ):
        create_pools([good, bad], {})
    # the settings that chose that memory lead, then what to do on this machine (no CUDA)
    assert info.value.message.startswith("pools[1].memory / pools[1].device: pool 'b': cannot create device memory "
                                         "on GPU 0: no CUDA driver"), info.value.message
    assert info.value.message.endswith(
        '; this machine has no CUDA driver: set pools[1].memory = "host" and pools[1].device = -1 (a host-memory pool)'
    ), info.value.message
    with pytest.raises(BadRequest, match="duplicate pool name 'a'"):
        create_pools([good, good], {})
    pools = create_pools([good, msgspec.structs.replace(good, name="c")], {})
    assert sorted(pools) == ["a", "c"]
    for p in pools.values():
        p.close()


def test_pool_rejects_memory_smaller_than_layout() -> None:
    mem = HostMemory(100)
    with pytest.raises(PoolError, match="memory holds 100 bytes, the layout needs"):
        Pool(cfg_for(), mem)
    mem.close()


def test_a_pool_on_a_gpu_this_machine_lacks_names_the_device_setting() -> None:
    """Where CUDA runs but the GPU does not exist, the remedy is the device setting."""
    from kvd.pool.pool import _located

    err = PoolError("pool 'g': cannot create device memory on GPU 99: invalid device ordinal")
    located = _located(err, 2, cfg_for("device", device=99, name="g"))
    assert located.message == (
        "pools[2].memory / pools[2].device: pool 'g': cannot create device memory on GPU 99: invalid device "
        'ordinal; pools[2].device must name a GPU this machine has; for a pool in host memory set memory = "host" '
        "and device = -1"
    )
    other = FabricUnavailable("pool 'g': fabric memory is required (require_fabric) but unavailable on GPU 0: x")
    assert _located(other, 2, cfg_for("device", device=0, name="g")) is other  # its own remedy already
