"""benchmarks/_affinity.py: cpulists parsed as Linux writes them; the binding is the
intersection with the allowed cores, applied to this process and undone by the test."""

from __future__ import annotations

import os

import pytest

from _affinity import bind_to_device, device_local_cpus, parse_cpulist

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity calls")


def test_parse_cpulist_ranges_and_singles() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("5") == {5}
    assert parse_cpulist("") == set()
    with pytest.raises(ValueError, match="bad cpulist"):
        parse_cpulist("7-3")


@pytest.fixture
def restore_affinity():
    before = os.sched_getaffinity(0)
    yield before
    os.sched_setaffinity(0, before)


def test_binds_to_the_allowed_local_cores(restore_affinity) -> None:
    allowed = sorted(restore_affinity)
    if len(allowed) < 2:
        pytest.skip("needs two allowed cores")
    local = {allowed[0], max(allowed) + 1000}  # one allowed core and one the process may not use
    assert bind_to_device(0, local_cpus=local) == {allowed[0]}
    assert os.sched_getaffinity(0) == {allowed[0]}


def test_no_change_without_a_usable_node(restore_affinity) -> None:
    allowed = set(restore_affinity)
    assert bind_to_device(0, local_cpus={max(allowed) + 1000}) is None  # nothing in common
    assert bind_to_device(0, local_cpus=set(allowed)) is None  # local already
    assert os.sched_getaffinity(0) == allowed


def test_sysfs_lookup_reads_the_device_node(tmp_path, monkeypatch) -> None:
    import _affinity as affinity

    monkeypatch.setattr(affinity, "_pci_bus_id", lambda index: "0000:1b:00.0")
    (tmp_path / "0000:1b:00.0").mkdir()
    (tmp_path / "0000:1b:00.0" / "local_cpulist").write_text("0-2,6\n")
    assert device_local_cpus(0, sysfs=tmp_path) == {0, 1, 2, 6}
    assert device_local_cpus(0, sysfs=tmp_path / "missing") is None
