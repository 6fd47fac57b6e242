"""kv_connector_extra_config parsing, slot sizing and per-rank naming (no vLLM needed)."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.config import (
    DEFAULT_DISK_CAPACITY_BYTES,
    OffloadConfig,
    num_slots,
    parse_size,
    rank_disk_path,
)

DISK = {"kv_offload_backend": "disk", "disk_path": "/nvme/kv.bin"}


def parse(**extra):
    return OffloadConfig.from_extra_config(extra)


def test_defaults_match_vllm() -> None:
    cfg = OffloadConfig.from_extra_config(None)
    assert (cfg.backend, cfg.disk_capacity_bytes, cfg.disk_buffer_slots) == ("cpu", 100 * 2**30, 2)
    assert (cfg.use_page_cache, cfg.encrypt, cfg.checksums, cfg.io_threads, cfg.named_file) == (
        False, True, True, None, False)
    assert cfg.cpu_bytes_to_use == 8 * 2**30
    assert parse(**DISK).disk_capacity_bytes == DEFAULT_DISK_CAPACITY_BYTES


def test_full_disk_config() -> None:
    cfg = parse(**DISK, disk_capacity_bytes="1.5 GiB", disk_buffer_slots=4, use_page_cache=True,
                encrypt=False, checksums=False, io_threads=16, named_file=True, lazy_offload=True,
                num_cpu_blocks=10, native_io="off")
    assert cfg.disk_mode and cfg.disk_capacity_bytes == 1610612736
    assert cfg.backend_kwargs() == {"encrypt": False, "checksums": False, "io_threads": 16, "named_file": True,
                                    "capacity_bytes": 1610612736, "native_io": False, "prefill": False}


@pytest.mark.parametrize("value, expected", [(True, True), ("on", True), ("OFF", False), (False, False),
                                             ("auto", None), (None, None)])
def test_native_io_is_a_key_of_its_own(value, expected) -> None:
    assert parse(**DISK, native_io=value).native_io is expected
    with pytest.raises(ValueError, match=r"^native_io='sometimes': expected on, off or auto"):
        parse(**DISK, native_io="sometimes")


@pytest.mark.parametrize("value, expected", [
    (107374182400, 107374182400), ("100GiB", 100 * 2**30), ("512MB", 512 * 10**6),
    ("1.5 GiB", 3 * 2**29), ("4kib", 4096), ("2 TB", 2 * 10**12), ("123", 123), (1e9, 10**9),
])
def test_sizes(value, expected) -> None:
    assert parse_size("disk_capacity_bytes", value) == expected


@pytest.mark.parametrize("value, match", [
    (True, "not a bool"), (1.5, "integer number of bytes"), ("1.3B", "whole number"),
    ("12 parsecs", "GiB"), ("-1GiB", "integer number of bytes"), (None, "integer number"),
])
def test_bad_sizes(value, match) -> None:
    with pytest.raises(ValueError, match=r"^disk_capacity_bytes=") as e:
        parse(**DISK, disk_capacity_bytes=value)
    assert e.match(match)


@pytest.mark.parametrize("text, expected", [
    ("1.07GB", 1_070_000_000), ("9007199254740993", 9007199254740993), ("0.1 KB", 100),
    ("1.000000000000000000000000000000001TB", None), ("9223372036854775807", 2**63 - 1),
    (".5 KiB", 512), ("3.0000 MiB", 3 << 20),
])
def test_sizes_are_exact_not_floats(text, expected) -> None:
    """Issue 23: through a float, "1.07GB" came out as 1,069,999,999.99... (refused) and
    2**53 + 1 bytes silently lost its last bit."""
    if expected is None:
        with pytest.raises(ValueError, match="not a whole number of bytes"):
            parse_size("disk_capacity_bytes", text)
    else:
        assert parse_size("disk_capacity_bytes", text) == expected


@pytest.mark.parametrize("text", ["1e9", "inf", "nan", "9223372036854775808", "1" * 5000, "\u0661\u0662 GB",
                                  "8 EiB", ".", "GiB", "1,5GiB"])
def test_what_is_not_a_size(text) -> None:
    with pytest.raises(ValueError, match=r"^disk_capacity_bytes="):
        parse_size("disk_capacity_bytes", text)


UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


@given(n=st.integers(0, 2**63 - 1), unit=st.sampled_from(sorted(UNITS)), pad=st.integers(0, 3))
def test_every_size_written_exactly_in_any_unit_reads_back(n, unit, pad) -> None:
    """n bytes written as the exact decimal of n / unit (a power of 2 or 10 has a finite one)."""
    whole, rest = divmod(n, UNITS[unit])
    digits = ""
    while rest:  # long division: terminates because 2 and 5 are the unit's only prime factors
        rest *= 10
        digits += str(rest // UNITS[unit])
        rest %= UNITS[unit]
    text = f"{whole}.{digits}{'0' * pad}{unit}" if digits or pad else f"{whole}{unit}"
    assert parse_size("k", text) == n


@given(st.text(max_size=40) | st.binary(max_size=10) | st.floats() | st.integers() | st.none())
def test_any_value_is_a_size_or_one_value_error(value) -> None:
    try:
        n = parse_size("disk_capacity_bytes", value)
    except ValueError as e:
        assert str(e).startswith("disk_capacity_bytes=") and "\n" not in str(e)
    else:
        assert isinstance(n, int) and not isinstance(n, bool) and n <= 2**63 - 1


@pytest.mark.parametrize("extra, match", [
    ({"kv_offload_backend": "nvme"}, r"kv_offload_backend='nvme': expected one of \('cpu', 'disk'\)"),
    ({"kv_offload_backend": "disk"}, r"requires disk_path"),
    ({**DISK, "disk_path": ""}, r"disk_path='': expected a non-empty"),
    ({**DISK, "disk_capacity_bytes": 0}, r"disk_capacity_bytes=0: must be > 0"),
    ({**DISK, "disk_capacity_bytes": -5}, r"disk_capacity_bytes=-5: must be > 0"),
    ({**DISK, "disk_buffer_slots": 0}, r"disk_buffer_slots=0: expected an integer >= 1"),
    ({**DISK, "disk_buffer_slots": True}, r"disk_buffer_slots=True: expected an integer >= 1"),
    ({**DISK, "io_threads": 0}, r"io_threads=0: expected an integer >= 1"),
    ({**DISK, "io_depth": 8}, r"renamed .*'io_depth' is now 'io_threads'"),
    ({**DISK, "io_unit_bytes": 0}, r"io_unit_bytes=0: must be > 0"),
    ({**DISK, "io_unit_bytes": "lots"}, r"io_unit_bytes='lots'"),
    ({**DISK, "encrypt": "yes"}, r"encrypt='yes': expected a JSON boolean"),
    ({**DISK, "use_page_cache": "false"}, r"use_page_cache='false': expected a JSON boolean"),
    ({**DISK, "checksums": 1}, r"checksums=1: expected a JSON boolean"),
    ({**DISK, "direct_io_alignment": 3000}, r"direct_io_alignment=3000: expected a power of two"),
    ({"num_cpu_blocks": 0}, r"num_cpu_blocks=0"),
])
def test_bad_values_name_key_value_and_allowed(extra, match) -> None:
    with pytest.raises(ValueError, match=match):
        OffloadConfig.from_extra_config(extra)


def test_unknown_key_did_you_mean() -> None:
    with pytest.raises(ValueError, match=r"'disk_capcity_bytes' \(did you mean 'disk_capacity_bytes'\?\)"):
        parse(**DISK, disk_capcity_bytes=1)
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\): 'zzz'; known keys"):
        parse(zzz=1)


def test_every_vllm_key_is_accepted() -> None:
    parse(lazy_offload=False, lazy_offload_min_prefix_tokens=16, num_cpu_blocks=8,
          cpu_bytes_to_use="16GiB", cpu_bytes_to_use_per_rank=2**30, async_init=False,
          cpu_offload_shared=False, cpu_hugepage_block_size="2MB")


def test_disk_keys_under_cpu_warn_once(caplog) -> None:
    with warnings.catch_warnings(record=True) as w, caplog.at_level(logging.WARNING, "kvoffload.config"):
        warnings.simplefilter("always")
        cfg = parse(disk_path="/x", disk_buffer_slots=4, checksums=False)
    assert not cfg.disk_mode
    assert len(w) == 1 and "disk_path, disk_buffer_slots, checksums" in str(w[0].message)
    assert len(caplog.records) == 1 and "ignoring disk-only" in caplog.records[0].getMessage()


def test_no_warning_in_disk_mode() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse(**DISK, checksums=True)


def test_cpu_bytes_per_rank() -> None:
    assert parse(cpu_bytes_to_use="8GiB").cpu_bytes_per_rank(4) == 2 * 2**30
    assert parse(cpu_bytes_to_use="8GiB", cpu_bytes_to_use_per_rank=5).cpu_bytes_per_rank(4) == 5


def test_normalized_extra_gives_vllm_ints() -> None:
    extra = {**DISK, "disk_capacity_bytes": "1GiB", "checksums": False}
    out = OffloadConfig.from_extra_config(extra).normalized_extra(extra)
    assert out == {**extra, "disk_capacity_bytes": 2**30}


def test_num_slots_one_rule() -> None:
    assert num_slots(10 * 8192, 8192) == 10
    assert num_slots(8192 + 8191, 8192) == 1
    with pytest.raises(ValueError, match="smaller than one disk slot"):
        num_slots(8191, 8192)


def test_slot_sizing_pads_under_direct_io_only() -> None:
    cfg = parse(**DISK, disk_capacity_bytes=2 * 4224)
    assert cfg.slot_bytes(4224) == 8192
    assert cfg.num_disk_slots(4224) == 1
    page = parse(**DISK, disk_capacity_bytes=2 * 4224, use_page_cache=True)
    assert page.slot_bytes(4224) == 4224 and page.num_disk_slots(4224) == 2
    assert parse(**DISK, direct_io_alignment=8192).slot_bytes(4224) == 8192
    assert parse(**DISK, direct_io_alignment=512).slot_bytes(4224) == 8192  # never below 4096


def test_rank_paths_do_not_collide_when_every_process_sees_cuda0() -> None:
    # TP=2 x PP=2 x DP=2, one process per GPU, each with CUDA_VISIBLE_DEVICES=<one gpu>.
    paths = {rank_disk_path("/nvme/kv.bin", dp, r) for dp in range(2) for r in range(4)}
    assert len(paths) == 8
    assert rank_disk_path("/nvme/kv.bin", 1, 3) == "/nvme/kv.bin.dp1.rank3"


def test_importing_kvoffload_never_imports_vllm() -> None:
    code = "import sys, kvoffload, kvoffload.config; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_importing_kvoffload_config_or_kvsim_never_imports_torch() -> None:
    # kvsim runs kvoffload's sizing rule; importing it must not cost torch's 1-2 s.
    code = "import sys, kvoffload, kvoffload.config, kvsim.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_connector_without_vllm_names_the_supported_version() -> None:
    pytest.importorskip("kvoffload.vllm")
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed; tests/test_vllm_connector.py covers it")
    import kvoffload.vllm as kvv

    with pytest.raises(ImportError, match=r"^kvoffload\.vllm needs vLLM 0\.32\.x or 0\.33\.x installed: "):
        kvv.KvoffloadConnector


def test_prefill_file_is_a_bool_key() -> None:
    assert parse(**DISK, prefill_file=True).backend_kwargs()["prefill"] is True
    with pytest.raises(ValueError, match="prefill_file"):
        parse(**DISK, prefill_file="sometimes")


def test_io_unit_bytes_is_a_size_key_passed_to_the_backend() -> None:
    # The unit size trades pinned staging (3 x io_threads x io_unit_bytes per disk path)
    # against the GIL waits per byte beside a busy engine: the operator sets it from vLLM.
    assert "io_unit_bytes" not in parse(**DISK).backend_kwargs()  # the backend's default
    cfg = parse(**DISK, io_unit_bytes="8MiB")
    assert cfg.io_unit_bytes == 8 << 20 and cfg.backend_kwargs()["io_unit_bytes"] == 8 << 20
    assert cfg.normalized_extra({**DISK, "io_unit_bytes": "8MiB"})["io_unit_bytes"] == 8 << 20


# --- one source for the keys the connector and the tier share ---------------------------

SHARED_VALUES = [
    ("io_unit_bytes", "8MiB"), ("io_unit_bytes", 0), ("io_unit_bytes", "4 furlongs"), ("io_unit_bytes", True),
    ("disk_capacity_bytes", "1.5GiB"), ("disk_capacity_bytes", -1), ("io_threads", 3), ("io_threads", "4"),
    ("encrypt", False), ("encrypt", "false"), ("checksums", False), ("use_page_cache", True), ("named_file", 1),
    ("native_io", "off"), ("native_io", "maybe"), ("prefill_file", True), ("persist", "yes"),
]


def _parsed(parse):
    try:
        return parse()
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("key,value", SHARED_VALUES)
def test_the_connector_and_the_tier_read_a_shared_key_alike(key, value):
    # The same value of a shared key means the same setting, or the same refusal, in
    # kv_connector_extra_config and in a secondary_tiers entry: both parse it through
    # DiskSettings, which holds its one default and its one check.
    from kvoffload.vllm_slot_tier import TierConfig

    conn = _parsed(lambda: OffloadConfig.from_extra_config({"kv_offload_backend": "disk", "disk_path": "/d/kv",
                                                            key: value}))
    tier = _parsed(lambda: TierConfig.from_tier_config({"disk_path": "/d/kv", key: value}))
    if isinstance(conn, str) or isinstance(tier, str):
        assert conn == tier, (conn, tier)
    else:
        assert getattr(conn, key) == getattr(tier, key)


def test_each_shared_key_has_one_default_and_one_definition():
    import dataclasses

    from kvoffload.config import DISK_SETTING_KEYS, PERSIST_KEYS, DiskSettings
    from kvoffload.vllm_slot_tier import TierConfig

    shared = {f.name for f in dataclasses.fields(DiskSettings)}
    assert shared == (set(DISK_SETTING_KEYS) - set(PERSIST_KEYS)) | {"persist"}
    for key in shared:
        # Inherited, not redeclared: the field (its default, its comment's place) is DiskSettings'.
        assert OffloadConfig.__dataclass_fields__[key] is DiskSettings.__dataclass_fields__[key], key
        assert TierConfig.__dataclass_fields__[key] is DiskSettings.__dataclass_fields__[key], key
    assert OffloadConfig().io_unit_bytes is None and TierConfig(disk_paths=("/d/kv",)).io_unit_bytes is None
