import csv
import warnings

import pytest
import torch

from ecekern import bench


def test_time_fn_on_cpu_reports_ordered_percentiles():
    x = torch.randn(10_000)
    t = bench.time_fn(lambda: torch.sin(x), warmup_ms=1, rep_ms=10, device="cpu")
    assert t.n >= 5
    assert 0 < t.p10 <= t.median <= t.p90


def test_time_fn_times_slow_calls_min_reps_times():
    import time

    t = bench.time_fn(
        lambda: time.sleep(0.02), warmup_ms=0, rep_ms=1, device="cpu", min_reps=4
    )
    assert t.n == 4 and t.median >= 20


def test_time_fn_sees_the_difference_between_small_and_large_work():
    small, large = torch.randn(1_000), torch.randn(2_000_000)
    t_small = bench.time_fn(lambda: small.sum(), warmup_ms=1, rep_ms=20, device="cpu")
    t_large = bench.time_fn(lambda: large.exp(), warmup_ms=1, rep_ms=20, device="cpu")
    assert t_large.median > t_small.median


def test_quantile():
    assert bench._quantile([3.0], 0.5) == 3.0
    assert bench._quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert bench._quantile([0.0, 10.0], 0.1) == pytest.approx(1.0)


def test_dtype_label_and_tf32_switch():
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        bench.set_tf32(True)
        assert bench.dtype_label(torch.float32) == "float32+tf32"
        assert bench.dtype_label(torch.bfloat16) == "bfloat16"
        with pytest.warns(UserWarning, match="float64"):
            assert bench.dtype_label(torch.float64) == "float64"
        bench.set_tf32(False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert bench.dtype_label(torch.float64) == "float64"
        assert bench.dtype_label(torch.float32) == "float32"
    finally:
        bench.set_tf32(before)


def test_floor_is_the_larger_of_bytes_and_flops():
    # 4.3 GB at 4300 GB/s is 1 ms; 100 TFLOP at 50 TFLOP/s is 2 s
    assert bench.floor_ms(4.3e9, 0, 4300) == pytest.approx(1.0)
    assert bench.floor_ms(4.3e9, 100e12, 4300, 50) == pytest.approx(2000.0)


def test_provenance_and_csv_round_trip(tmp_path):
    p = bench.provenance(torch.float32, command="unit test")
    for key in ("device", "driver", "torch", "triton", "commit", "dtype", "date"):
        assert p[key] != ""
    assert p["command"] == "unit test"
    rows = [{"a": 1, "b": 2.5, **p}, {"a": 2, "c": "x"}]
    path = bench.write_csv(rows, tmp_path / "sub" / "r.csv")
    got = list(csv.DictReader(path.open()))
    assert got[0]["a"] == "1" and got[1]["c"] == "x" and got[1]["b"] == ""
    assert list(got[0])[:2] == ["a", "b"]


def test_peak_memory_is_nan_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert bench.peak_memory(lambda: None) != bench.peak_memory(lambda: None)


@pytest.mark.gpu
def test_time_fn_and_peak_memory_on_gpu():
    x = torch.randn(1 << 24, device="cuda")
    t = bench.time_fn(lambda: x * 2, warmup_ms=5, rep_ms=20)
    assert 0 < t.p10 <= t.median <= t.p90
    slow = bench.time_fn(lambda: torch.cuda._sleep(50_000_000), rep_ms=1, min_reps=5)
    assert slow.n >= 5
    peak = bench.peak_memory(lambda: x * 2)
    assert peak >= x.numel() * 4


def test_graph_timers_need_cuda():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert bench.time_graph(lambda: None) is None
    assert bench.time_back_to_back([lambda: None]) is None


@pytest.mark.gpu
def test_back_to_back_time_is_per_call():
    # 64 MiB per call: a copy at ~4 TB/s is ~30 us; one graph replay holds 20 calls
    a = [torch.randn(1 << 24, device="cuda") for _ in range(2)]
    out = [torch.empty_like(t) for t in a]
    fns = [lambda i=i: torch.neg(a[i], out=out[i]) for i in range(2)]
    one = bench.time_back_to_back(fns[:1], rounds=1)
    many = bench.time_back_to_back(fns, rounds=10)
    assert 0 < many.p10 <= many.median <= many.p90 and many.n >= 10
    # per call, not per replay: twenty calls do not take twenty times one
    assert many.median < 3 * one.median
    assert torch.equal(out[1], -a[1])


def test_traffic_models():
    from ecekern import linear, zonal

    t = linear.traffic(100_000, 192, 192, 3, 4)
    # intensity of the needed flops is K O / (2 (K + O)) flop/byte when B dominates
    assert t["flops"] / t["bytes"] == pytest.approx(192 * 192 / (2 * 384), rel=0.02)
    assert t["flops_dense"] == 3 * t["flops"]
    z = zonal.traffic(365_000, 4096, 3, 32, 4)
    # the numbers: about 160 MB read, 8 MB written, a 700 MB message tensor
    assert 150e6 < z["bytes_fwd"] < 180e6
    assert 700e6 < z["message_bytes"] < 800e6
