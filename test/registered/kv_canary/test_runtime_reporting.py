"""The runtime's reporting pieces and its read-back: a violation ring row decoded once into a
record, rows merged into incidents (one per slot, position, row and pool kind, reasons
united), the structured violation line (format, parse, round trip, request ids) and its
explanation block, the ring-full line; the device→host handler (packed read-back, exception
safety, the emptied window) and the parallel lanes off CUDA. The serving loop these feed:
``test_runtime_core.py``."""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import pytest
import torch

from sglang.jit_kernel.kv_canary import consts as c
from sglang.jit_kernel.kv_canary.consts import FailReason, to_int64
from sglang.jit_kernel.kv_canary.types import CanaryLaunchTag, PoolKind
from sglang.srt.kv_canary.config import CanaryMode
from sglang.srt.kv_canary.manager import DelayedDeviceHostHandler
from sglang.srt.kv_canary.violations.reporter import ViolationReporter
from sglang.srt.kv_canary.violations.lines import (
    VIOLATION_LINE_PREFIX,
    ViolationLine,
    format_violation_block,
    format_violation_line,
    parse_violation_line,
    parse_violation_lines,
)
from sglang.srt.kv_canary.violations.records import (
    ViolationRecord,
    decode_ring_rows,
    merge_incidents,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-test-cpu")

pytestmark = pytest.mark.usefixtures("reference_kernels_on_cpu")


# ---- reporting pieces --------------------------------------------------------------------------


def test_violation_line_format():
    row = [int(CanaryLaunchTag.TAIL_K_FULL), 812, 37, 5, -1, -2, 0x1234, 4 | 1, 36, 7, -1]
    assert format_violation_line(ViolationRecord.from_row(row), step=41) == (
        f"{VIOLATION_LINE_PREFIX} launch_tag=TAIL_K_FULL fail_reason=verify_chain_hash+"
        "verify_real_kv_hash slot_idx=812 position=37 stored_token=5 expected_token=-1 "
        "stored_chain_hash=0xfffffffffffffffe expected_aux=0x0000000000001234 forward_step=41 "
        "read_position=36 req_to_token_row=7 seen_by=TAIL_K_FULL kv_layer=-1 rids=-"
    )
    # a per-layer fingerprint names its layer (and the block says which half)
    deep = row[:-1] + [27]
    deep[0] = int(CanaryLaunchTag.SWEEP_V_FULL)
    line = format_violation_line(ViolationRecord.from_row(deep), step=41)
    assert " seen_by=SWEEP_V_FULL kv_layer=27 rids=-" in line
    assert parse_violation_line(line).kv_layer == 27
    assert "Layer 27's V row" in format_violation_block(ViolationRecord.from_row(deep), 41)
    assert "Layer" not in format_violation_block(ViolationRecord.from_row(row), 41)


def test_a_ring_row_is_decoded_once_into_a_record():
    """``ViolationRecord.from_row`` reads each column by its ``consts`` index (a row of another
    width is refused, naming both widths); it is the runtime's one reader of the columns."""
    row = _row(
        CanaryLaunchTag.SWEEP_V_SWA,
        812,
        37,
        5,
        9,
        -2,
        0x1234,
        FailReason.VERIFY_REAL_KV_HASH_MISMATCH,
        read_position=36,
        req_row=-2,
        kv_layer=3,
    )
    rec = ViolationRecord.from_row(row)
    assert rec == ViolationRecord(
        launch_tag=int(CanaryLaunchTag.SWEEP_V_SWA),
        slot_idx=812,
        position=37,
        stored_token=5,
        expected_token=9,
        stored_chain_hash=-2,
        expected_aux=0x1234,
        fail_bits=int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH),
        read_position=36,
        req_to_token_row=-2,
        kv_layer=3,
    )
    assert rec.tag == CanaryLaunchTag.SWEEP_V_SWA and rec.tag_name == "SWEEP_V_SWA"
    assert rec.pool_kind == PoolKind.SWA and rec.on_host_tier  # -2: HOST_TIER_ROW
    unknown = ViolationRecord.from_row([99] + row[1:])
    assert unknown.tag is None and unknown.pool_kind is None and unknown.tag_name == "UNKNOWN_99"
    with pytest.raises(ValueError, match=f"has {c.VIOLATION_NUM_FIELDS} fields, got 10"):
        ViolationRecord.from_row(row[:-1])
    # nothing else in the runtime package indexes the ring's columns
    runtime = pathlib.Path(c.__file__).resolve().parents[2] / "srt" / "kv_canary"
    readers = sorted(
        p.relative_to(runtime).as_posix()
        for p in runtime.rglob("*.py")
        if "VIOLATION_FIELD_" in p.read_text()
    )
    assert readers == ["violations/records.py"]


def test_violation_line_names_requests_and_round_trips_odd_ids():
    """``rids=`` ends the line, after every earlier field in its order; ids with a
    comma, a blank or an equals sign survive the round trip (percent-encoded); none is ``-``."""
    row = [int(CanaryLaunchTag.HEAD_K_FULL), 812, 37, 5, -1, -2, 0x1234, 2, 36, 7, -1]
    inc = dataclasses.replace(
        merge_incidents(decode_ring_rows([row]))[0],
        rids=("a1b2", "user,req 7", "x=y%", "plain-id.3:4"),
    )
    line = format_violation_line(inc, step=41)
    assert line.endswith(
        " seen_by=HEAD_K_FULL kv_layer=-1 rids=a1b2,user%2Creq%207,x%3Dy%25,plain-id.3:4"
    )
    plain = format_violation_line(ViolationRecord.from_row(row), step=41)
    assert line.startswith(plain.removesuffix(" rids=-"))
    parsed = parse_violation_line("INFO something: " + line + " trailing")
    assert parsed.rids == ("a1b2", "user,req 7", "x=y%", "plain-id.3:4")
    assert (parsed.slot_idx, parsed.req_to_token_row, parsed.seen_by) == (812, 7, ("HEAD_K_FULL",))
    assert parse_violation_line(plain).rids == ()
    block = format_violation_block(inc, 41)
    assert "Requests touched: a1b2, user,req 7" in block


def test_one_line_per_incident_lists_every_tag():
    """HEAD and TAIL (and the V half) seeing one slot read for one position of one request in
    one forward window: one line, reasons united, every tag listed; another slot, position,
    row or pool kind is another incident."""
    head = _row(
        CanaryLaunchTag.HEAD_K_FULL,
        812,
        37,
        5,
        -1,
        0,
        0,
        FailReason.VERIFY_POSITION_MISMATCH,
        read_position=36,
        req_row=7,
    )
    tail = _row(
        CanaryLaunchTag.TAIL_K_FULL,
        812,
        37,
        5,
        -1,
        0,
        0,
        FailReason.VERIFY_POSITION_MISMATCH | FailReason.VERIFY_REAL_KV_HASH_MISMATCH,
        read_position=36,
        req_row=7,
    )
    tail_v = list(tail)
    tail_v[c.VIOLATION_FIELD_KERNEL_KIND] = int(CanaryLaunchTag.TAIL_V_FULL)
    nxt = _row(
        CanaryLaunchTag.HEAD_K_FULL,
        813,
        37,
        6,
        -1,
        0,
        0,
        FailReason.VERIFY_CHAIN_HASH_MISMATCH,
        read_position=37,
        req_row=7,
    )
    other_row = _row(
        CanaryLaunchTag.HEAD_K_FULL,
        812,
        37,
        5,
        -1,
        0,
        0,
        FailReason.VERIFY_POSITION_MISMATCH,
        read_position=36,
        req_row=8,
    )
    swa = _row(
        CanaryLaunchTag.HEAD_K_SWA,
        812,
        37,
        5,
        -1,
        0,
        0,
        FailReason.VERIFY_POSITION_MISMATCH,
        read_position=36,
        req_row=7,
    )
    incidents = merge_incidents(decode_ring_rows([head, nxt, tail, tail_v, other_row, swa]))
    assert [(i.record.slot_idx, i.record.req_to_token_row) for i in incidents] == [
        (812, 7),
        (813, 7),
        (812, 8),
        (812, 7),
    ]
    first = parse_violation_line(format_violation_line(incidents[0], step=9))
    assert first.launch_tag == "HEAD_K_FULL"
    assert first.seen_by == ("HEAD_K_FULL", "TAIL_K_FULL", "TAIL_V_FULL")
    assert first.fail_reasons == ("verify_position", "verify_real_kv_hash")
    assert (first.read_position, first.req_to_token_row) == (36, 7)
    assert [
        parse_violation_line(format_violation_line(i, step=9)).seen_by for i in incidents[1:]
    ] == [("HEAD_K_FULL",), ("HEAD_K_FULL",), ("HEAD_K_SWA",)]
    # the explanation names the req_to_token entry attention read
    block = format_violation_block(incidents[0], 9)
    assert "req_to_token[7, 36] = slot 812" in block and "holds position 37" in block
    assert "predecessor req_to_token[7, 36]" in format_violation_block(incidents[1], 9)
    # the explanation reads the incident's reasons, not its first row's: a chain break the
    # TAIL also saw as changed bytes is not blamed on the predecessor
    tail_kv = list(nxt)
    tail_kv[c.VIOLATION_FIELD_KERNEL_KIND] = int(CanaryLaunchTag.TAIL_K_FULL)
    tail_kv[c.VIOLATION_FIELD_FAIL_REASON_BITS] = int(
        FailReason.VERIFY_CHAIN_HASH_MISMATCH | FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    )
    (both,) = merge_incidents(decode_ring_rows([nxt, tail_kv]))
    assert "predecessor req_to_token" not in format_violation_block(both, 9)


def test_an_incident_unites_the_reasons_of_all_its_rows():
    """Every reason any row of the incident carries is on its line, whichever row carries it
    (not only the first's or the last's), and the line's other fields are the first row's."""
    reasons = (
        FailReason.VERIFY_POSITION_MISMATCH,
        FailReason.VERIFY_REAL_KV_HASH_MISMATCH,
        FailReason.VERIFY_CHAIN_HASH_MISMATCH,
    )
    tags = (CanaryLaunchTag.HEAD_K_FULL, CanaryLaunchTag.TAIL_K_FULL, CanaryLaunchTag.TAIL_V_FULL)
    rows = [
        _row(tag, 40, 9, 100 + i, -1, 0, 0, bits, read_position=9, req_row=3)
        for i, (tag, bits) in enumerate(zip(tags, reasons))
    ]
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        (inc,) = merge_incidents(decode_ring_rows([rows[i] for i in order]))
        assert inc.fail_bits == int(reasons[0] | reasons[1] | reasons[2])
        assert inc.seen_by == tuple(int(tags[i]) for i in order)
        line = parse_violation_line(format_violation_line(inc, step=4))
        assert line.fail_reasons == ("verify_chain_hash", "verify_position", "verify_real_kv_hash")
        assert line.stored_token == 100 + order[0] and line.launch_tag == tags[order[0]].name


def _row(
    tag, slot, pos, stored, expected, chain, aux, bits, *, read_position=0, req_row=-1, kv_layer=-1
):
    row = [0] * c.VIOLATION_NUM_FIELDS
    row[c.VIOLATION_FIELD_KV_LAYER] = kv_layer
    row[c.VIOLATION_FIELD_READ_POSITION] = read_position
    row[c.VIOLATION_FIELD_REQ_TO_TOKEN_ROW] = req_row
    row[c.VIOLATION_FIELD_KERNEL_KIND] = int(tag)
    row[c.VIOLATION_FIELD_SLOT_IDX] = slot
    row[c.VIOLATION_FIELD_POSITION] = pos
    row[c.VIOLATION_FIELD_STORED_TOKEN] = stored
    row[c.VIOLATION_FIELD_EXPECTED_TOKEN] = expected
    row[c.VIOLATION_FIELD_STORED_CHAIN_HASH] = to_int64(chain)
    row[c.VIOLATION_FIELD_EXPECTED_AUX] = to_int64(aux)
    row[c.VIOLATION_FIELD_FAIL_REASON_BITS] = int(bits)
    return row


@pytest.mark.parametrize(
    "tag,slot,pos,stored,expected,chain,aux,bits,step",
    [
        (
            CanaryLaunchTag.TAIL_K_FULL,
            812,
            37,
            5,
            -1,
            (1 << 64) - 2,
            0x1234,
            FailReason.VERIFY_CHAIN_HASH_MISMATCH | FailReason.VERIFY_REAL_KV_HASH_MISMATCH,
            41,
        ),
        # hashes with the top bit set (negative int64 in the ring), negative tokens / position
        (
            CanaryLaunchTag.HEAD_K_SWA,
            0,
            -1,
            -7,
            -123456,
            0x8000000000000000,
            0xFEDCBA9876543210,
            FailReason.VERIFY_TOKEN_MISMATCH,
            0,
        ),
        (
            CanaryLaunchTag.SWEEP_K_FULL,
            2**40,
            131071,
            151935,
            0,
            0,
            (1 << 64) - 1,
            FailReason.VERIFY_POSITION_MISMATCH,
            10**9,
        ),
        (
            CanaryLaunchTag.HEAD_K_FULL,
            3,
            3,
            1,
            2,
            0xDEADBEEF,
            9,
            FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH,
            7,
        ),
    ],
)
def test_violation_line_round_trip(tag, slot, pos, stored, expected, chain, aux, bits, step):
    row = _row(
        tag,
        slot,
        pos,
        stored,
        expected,
        chain,
        aux,
        bits,
        read_position=pos + 1,
        req_row=slot % 5 - 1,
    )
    line = format_violation_line(ViolationRecord.from_row(row), step=step)
    want = ViolationLine(
        launch_tag=tag.name,
        fail_reasons=tuple(FailReason.describe(int(bits)).split("+")),
        slot_idx=slot,
        position=pos,
        stored_token=stored,
        expected_token=expected,
        stored_chain_hash=chain,
        expected_aux=aux,
        forward_step=step,
        read_position=pos + 1,
        req_to_token_row=slot % 5 - 1,
        seen_by=(tag.name,),
        kv_layer=-1,
        rids=(),
    )
    assert parse_violation_line(line) == want
    assert all(0 <= h < 1 << 64 for h in (want.stored_chain_hash, want.expected_aux))
    # a ring row as the host reads it back (an int64 tensor row) formats the same way
    read_back = torch.tensor(row, dtype=torch.int64).tolist()
    assert format_violation_line(ViolationRecord.from_row(read_back), step=step) == line
    # inside a log line (timestamp / logger prefix, trailing text) and inside a larger text
    logged = f"[2026-01-01 00:00:00 TP0] WARNING kv_canary: {line}\n  KV slot {slot} failed ..."
    assert parse_violation_line(logged) == want
    assert parse_violation_lines("noise\n" + logged + "\nmore noise\n") == [want]


def test_the_reporter_takes_the_mode_the_config_parsed():
    """``--kv-canary`` is parsed once, into ``CanaryConfig.mode``; the reporter refuses a
    string rather than parse it again."""
    with pytest.raises(TypeError, match="takes a CanaryMode, got 'raise'"):
        ViolationReporter("raise")
    assert ViolationReporter(CanaryMode.LOG).mode is CanaryMode.LOG


def test_parse_violation_line_ignores_other_lines():
    assert parse_violation_line("kv_canary stats: step=3 protected_tokens=10") is None
    assert parse_violation_line("") is None
    assert parse_violation_lines("nothing to see\n") == []
    # the ring-full line starts with the same prefix but is not a violation
    reporter = ViolationReporter(CanaryMode.RAISE)
    row = _row(
        CanaryLaunchTag.TAIL_K_FULL, 5, 2, 1, 1, 0, 0, FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    )
    with pytest.raises(RuntimeError) as exc:
        reporter.report(merge_incidents(decode_ring_rows([row])), step=9, dropped=3)
    text = str(exc.value)
    dropped_line = next(x for x in text.splitlines() if "not recorded" in x)
    assert dropped_line.startswith(VIOLATION_LINE_PREFIX)
    assert parse_violation_line(dropped_line) is None
    (only,) = parse_violation_lines(text, unique=False)
    assert (only.slot_idx, only.forward_step) == (5, 9)
    with pytest.raises(RuntimeError) as exc:
        reporter.report([], step=9, dropped=4)
    assert VIOLATION_LINE_PREFIX in str(exc.value)
    assert parse_violation_lines(str(exc.value), unique=False) == []


@dataclasses.dataclass(frozen=True)
class _Watched:
    x: torch.Tensor


def test_device_host_handler_is_exception_safe():
    src = torch.arange(4)
    h = DelayedDeviceHostHandler(_Watched(x=src))
    assert h.synchronous and not h.has_pending
    h.stage()
    src.add_(10)  # staged copies are snapshots
    with pytest.raises(ValueError):
        h.consume(lambda host: (_ for _ in ()).throw(ValueError("consumer failed")))
    assert not h.has_pending  # no dangling future
    assert h.consume(lambda host: None) is False
    h.stage()
    got = {}
    assert h.consume(lambda host: got.update(x=host.x.tolist(), type=type(host)))
    assert got["x"] == [10, 11, 12, 13]
    assert got["type"] is _Watched  # the consumer gets the watched type back


@dataclasses.dataclass(frozen=True)
class _Nested:
    index: torch.Tensor
    ring: torch.Tensor
    statuses: tuple
    flags: torch.Tensor


def test_device_host_handler_packs_mixed_dtypes_into_one_buffer():
    """Every watched tensor travels in one packed buffer; each host copy is its own tensor
    back (dtype, shape, values), aligned, and a later stage does not disturb the copy the
    consumer has not read yet (two buffers alternate)."""
    src = _Nested(
        index=torch.tensor([3], dtype=torch.int32),
        ring=torch.arange(12, dtype=torch.int64).reshape(4, 3) - 5,
        statuses=(
            _Watched(x=torch.tensor([1, 0, 1], dtype=torch.int32)),
            _Watched(x=torch.tensor([-(2**40)], dtype=torch.int64)),
        ),
        flags=torch.tensor([True, False, True, True]),
    )
    h = DelayedDeviceHostHandler(src)
    assert h.num_bytes == 4 + 12 * 8 + 3 * 4 + 8 + 4
    h.stage()
    first = h._pending  # step T's copies, not consumed yet
    src.ring.mul_(-1)
    src.statuses[0].x.fill_(7)
    src.index.fill_(9)
    got = {}
    assert h.consume(lambda host: got.update(host=host))
    host = got["host"]
    assert type(host) is _Nested and type(host.statuses[1]) is _Watched
    assert host.index.tolist() == [3] and host.index.dtype == torch.int32
    assert host.ring.shape == (4, 3) and torch.equal(host.ring, -src.ring)
    assert host.statuses[0].x.tolist() == [1, 0, 1]
    assert host.statuses[1].x.tolist() == [-(2**40)] and host.flags.tolist() == [
        True,
        False,
        True,
        True,
    ]
    for leaf in (host.index, host.ring, host.statuses[0].x, host.statuses[1].x, host.flags):
        assert leaf.data_ptr() % leaf.element_size() == 0
    h.stage()  # step T+1 into the other buffer: T's host copies stay as they were
    assert first.get().statuses[0].x.tolist() == [1, 0, 1]
    h.consume(lambda host: got.update(again=host))
    assert got["again"].statuses[0].x.tolist() == [7, 7, 7]
    assert got["again"].index.tolist() == [9] and torch.equal(got["again"].ring, src.ring)


def test_device_host_handler_refuses_strided_tensors():
    with pytest.raises(ValueError, match="contiguous"):
        DelayedDeviceHostHandler(_Watched(x=torch.arange(8).reshape(2, 4).t()))


def test_device_host_handler_empties_the_named_window_after_its_copy():
    """``zero_after_copy`` names watched tensors reset right after each copy (the violation
    ring's write index: one window per stage); the consumer still sees the value copied."""
    index = torch.tensor([3], dtype=torch.int32)
    src = _Nested(
        index=index,
        ring=torch.zeros(2, 3, dtype=torch.int64),
        statuses=(),
        flags=torch.tensor([True]),
    )
    h = DelayedDeviceHostHandler(src, zero_after_copy=(index,))
    h.stage()
    assert index.tolist() == [0]
    got = {}
    h.consume(lambda host: got.update(index=host.index.tolist()))
    assert got["index"] == [3]


def test_device_host_handler_refuses_to_zero_what_it_does_not_watch():
    watched = torch.zeros(2)
    with pytest.raises(ValueError, match=r"zero_after_copy entries \[1\] are not leaves"):
        DelayedDeviceHostHandler(_Watched(x=watched), zero_after_copy=(watched, torch.zeros(2)))


def test_device_host_handler_captures_only_on_cuda():
    h = DelayedDeviceHostHandler(_Watched(x=torch.zeros(2)))
    with pytest.raises(RuntimeError, match="captured only on CUDA"):
        h.capture()


def test_parallel_lanes_run_in_order_off_cuda_and_refuse_more_sequences_than_lanes():
    from sglang.srt.kv_canary.cuda_streams import ParallelLanes

    lanes = ParallelLanes(3, "cpu")
    order = []
    lanes.run([lambda i=i: order.append(i) for i in range(3)])
    assert order == [0, 1, 2]
    with pytest.raises(ValueError, match="4 sequences for 3 lanes"):
        lanes.run([lambda: None] * 4)
    with pytest.raises(ValueError, match="lanes >= 1, got 0"):
        ParallelLanes(0, "cpu")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
