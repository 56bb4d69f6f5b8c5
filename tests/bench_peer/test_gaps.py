"""bench/profile/gaps.py: idle time inside the busy span is charged to the right neighbours, with
overlapping streams counted busy once and the lead/tail outside the span kept apart."""

from __future__ import annotations

from bench.profile.gaps import Activity, idle_gaps


def us(x: float) -> int:
    return int(x * 1000)


def test_gaps_merge_streams_and_charge_neighbours() -> None:
    acts = [
        Activity("nvjet_gemm", us(0), us(100)),
        Activity("ncclDevKernel_AllReduce", us(50), us(300)),  # other stream, overlaps: no gap
        Activity("_rmsnorm_kernel", us(305), us(310)),  # 5 us after the NCCL kernel ended
        Activity("_decode_split_kernel", us(810), us(900)),  # a 500 us host stall
        Activity("_gemv_kernel", us(900.5), us(950)),  # 0.5 us: counted idle, not listed
    ]
    out = idle_gaps(acts, wall_s=0.002, rows=5)
    assert out["span_s"] == 0.00095
    assert abs(out["idle_in_span_s"] - 0.0005055) <= 1e-6
    assert out["outside_span_s"] == 0.00105
    assert out["gaps_by_size"] == {"0-10us": [1, 0.000005], "100-1000us": [1, 0.0005]}
    assert list(out["gaps_by_kinds"]) == ["norm -> attention", "all_reduce -> norm"]
    top = out["gaps_by_names"][0]
    assert top[0] == "_rmsnorm_kernel -> _decode_split_kernel" and top[1] == 1


def test_no_activity_is_all_outside() -> None:
    assert idle_gaps([], wall_s=1.5) == {"span_s": 0.0, "idle_in_span_s": 0.0,
                                         "outside_span_s": 1.5}


def test_host_stalls_count_collections_and_compiles() -> None:
    import gc

    from bench.profile.stalls import host_stalls

    got: dict = {}
    with host_stalls(got):
        gc.collect()
    assert got["gc"]["gen2"][0] >= 1  # count, total ms, max ms
    assert got["triton_compiles"][0] == 0
    assert set(got) == {"gc", "triton_compiles", "allocator"}
