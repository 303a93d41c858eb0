"""The torch paths' default chunk size: a measured constant, overridable by the environment,
never derived from the cache size the OS reports (issue 25: a VM reporting a 300 MiB L3 got
chunks ~10x too large). Values only; speed is measured by scripts/chunk_sweep.py, not here."""
from __future__ import annotations

import pytest

import qstrat
from qstrat.errors import ConfigError
from qstrat.serializers import chunking


def test_default_is_the_measured_constant_whatever_the_reported_cache(monkeypatch):
    monkeypatch.delenv(chunking.CHUNK_ENV, raising=False)
    for reported in (None, 32 << 20, 300 << 20, 1 << 30):  # the Intel VM reported 300 MiB
        monkeypatch.setattr(chunking, "reported_llc_bytes", lambda r=reported: r)
        assert chunking.chunk_setting() == chunking.ChunkSetting(1 << 20, "default")
        assert qstrat.get_serializer("mxfp8")._chunk_elements() == 1 << 20


def test_environment_overrides_and_serializer_option_overrides_both(monkeypatch):
    monkeypatch.setenv(chunking.CHUNK_ENV, " 262144 ")
    assert chunking.chunk_setting() == chunking.ChunkSetting(262144, "env")
    assert chunking.cache_chunk_elements() == 262144
    assert qstrat.get_serializer("block_fp8")._chunk_elements() == 262144
    assert qstrat.get_serializer("block_fp8", chunk_elements=4096)._chunk_elements() == 4096
    monkeypatch.setenv(chunking.CHUNK_ENV, "")
    assert chunking.chunk_setting().source == "default"


@pytest.mark.parametrize("value", ["0", "-5", "1M", "1.5e6"])
def test_malformed_environment_value_is_a_config_error_naming_it(monkeypatch, value):
    monkeypatch.setenv(chunking.CHUNK_ENV, value)
    with pytest.raises(ConfigError, match=rf"QSTRAT_CHUNK_ELEMENTS='{value}': expected an integer >= 1"):
        chunking.chunk_setting()


def test_chunk_workers_follow_torch_threads():
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert chunking.chunk_workers() == 1
    finally:
        torch.set_num_threads(before)
    assert chunking.chunk_workers() == before


def _fake_sysfs(root, caches):
    for i, (kind, size) in enumerate(caches):
        (root / f"index{i}").mkdir(parents=True)
        (root / f"index{i}" / "type").write_text(kind + "\n")
        (root / f"index{i}" / "size").write_text(size + "\n")
    return root


def test_reported_llc_reads_the_largest_data_cache(tmp_path):
    intel_vm = _fake_sysfs(tmp_path / "a", [("Data", "48K"), ("Instruction", "1024M"), ("Unified", "2048K"),
                                            ("Unified", "307200K")])
    assert chunking.reported_llc_bytes(intel_vm) == 300 << 20
    assert chunking.reported_llc_bytes(_fake_sysfs(tmp_path / "b", [("Unified", "32M")])) == 32 << 20
    assert chunking.reported_llc_bytes(_fake_sysfs(tmp_path / "c", [("Data", "bogus")])) is None
    assert chunking.reported_llc_bytes(tmp_path / "none") is None
