"""MemoryMonitor: records every k updates, standalone and through wrap(monitor=k); summary; state_dict."""
import subprocess
import sys

import pytest
import torch

import memwrap
from memwrap.memory import MemoryMonitor
from memwrap.memory.monitor import process_memory


def test_records_every_k_updates_with_process_memory_on_cpu():
    lines = []
    m = MemoryMonitor(every=2, device="cpu", log=lines.append)
    for _ in range(5):
        m.step()
    assert [r["update"] for r in m.records] == [2, 4]
    assert len(lines) == 2 and "update 2" in lines[0]
    for r in m.records:
        assert r["peak_rss"] >= r["rss"] > 0


def test_peak_rss_sees_a_large_allocation_between_records():
    # In a fresh process: in a long test session freed-but-resident heap pages can absorb the
    # allocation without moving the high-water mark, which says nothing about the monitor.
    code = """
import torch
from memwrap.memory import MemoryMonitor
m = MemoryMonitor(every=1, device="cpu", log=None)
m.step()
big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
del big
m.step()
print(m.records[1]["peak_rss"] - m.records[0]["rss"])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    # the record after the allocation holds a peak at least 64 MiB above the RSS of the one before
    assert int(out.stdout.strip().splitlines()[-1]) >= 60 * 2**20


def test_summary_table_and_state_dict_round_trip():
    m = MemoryMonitor(every=1, device="cpu", log=None)
    assert "no memory records" in m.summary()
    m.step(), m.step()
    text = m.summary()
    assert "peak_rss" in text and "max" in text.splitlines()[-1]
    other = MemoryMonitor(every=1, device="cpu", log=None)
    other.load_state_dict(m.state_dict())
    assert other.records == m.records and other.every == 1 and other.count == 2
    other.step()
    assert other.records[-1]["update"] == 3


def test_wrap_option_calls_the_monitor_after_real_updates_only():
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wmodel, wopt = memwrap.wrap(model, opt, accumulate=2, monitor=1)
    wopt.monitor.log = None
    for _ in range(6):
        wmodel(torch.randn(4, 8)).pow(2).mean().backward()
        wopt.step()
        wopt.zero_grad()
    assert [r["update"] for r in wopt.monitor.records] == [1, 2, 3]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_every_is_rejected(bad):
    with pytest.raises(ValueError, match="every"):
        MemoryMonitor(every=bad)


def test_unknown_device_is_rejected():
    with pytest.raises(ValueError, match="device"):
        MemoryMonitor(device="meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_device_without_cuda_is_rejected():
    with pytest.raises(ValueError, match="CUDA is not available.*device='cpu'"):
        MemoryMonitor(device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_records_allocator_peaks():
    m = MemoryMonitor(every=1, device="cuda", log=None)
    x = torch.empty(32 * 2**20, dtype=torch.uint8, device="cuda")
    del x
    m.step()
    assert m.records[0]["peak_allocated"] >= 32 * 2**20
    assert m.records[0]["peak_reserved"] >= m.records[0]["peak_allocated"]


def test_process_memory_reads_proc():
    mem = process_memory()
    assert mem["peak"] >= mem["rss"] > 0


def test_resume_keeps_this_runs_every_and_the_clock():
    first = MemoryMonitor(every=2, device="cpu", log=None)
    for _ in range(4):
        first.step()
    state = first.state_dict()
    second = MemoryMonitor(every=3, device="cpu", log=None)
    with pytest.warns(UserWarning, match="saved with every=2"):
        second.load_state_dict(state)
    for _ in range(2):
        second.step()
    assert second.every == 3 and [r["update"] for r in second.records] == [2, 4, 6]
    assert second.records[-1]["time_s"] >= second.records[1]["time_s"]  # the clock did not restart at 0


def test_monitor_without_an_optimizer_is_refused():
    with pytest.raises(TypeError, match="no optimizer was given"):
        memwrap.wrap(torch.nn.Linear(2, 2), monitor=1)


def test_memwraps_profiler_prints_nothing_and_lets_the_measured_code_print(capfd):
    """The CPU measurements run torch.profiler; its native start/stop lines (kineto's 'USDT ... profiler_start')
    are held back, what the measured code itself prints (Python or native, stdout or stderr) is not."""
    import os

    from memwrap.memory.measure import allocator_growth

    def fn():
        os.write(2, b"native line from the measured code\n")
        print("python line from the measured code", flush=True)
        return torch.ones(1024)

    grown = allocator_growth(fn)
    out, err = capfd.readouterr()
    assert grown >= 4096
    for noise in ("USDT", "SyncActivityProfilerHandler", "profiler_start", "profiler_stop"):
        assert noise not in err and noise not in out, err
    assert "native line from the measured code" in err and "python line from the measured code" in out
    peak = memwrap.measure_peak(lambda: torch.nn.Linear(8, 8), torch.randn(2, 8), steps=1)["peak"]
    out, err = capfd.readouterr()
    assert peak > 0 and "USDT" not in err and "profiler_" not in err, err
