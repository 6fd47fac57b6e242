"""The supported vLLM range: checked once when an adapter loads, one line outside it."""

from __future__ import annotations

import sys
import types

import pytest

from kvoffload.vllm_version import SUPPORTED_RELEASES, check_vllm, parse_release


@pytest.mark.parametrize("text, want", [
    ("0.32.0", (0, 32)), ("0.33.0", (0, 33)), ("0.33.1.dev4+g1234abc", (0, 33)), ("v0.32.2", (0, 32)),
    ("1.0", (1, 0)), ("0.3", (0, 3)), ("unknown", None), ("", None), ("0.", None), ("x0.33", None),
])
def test_parse_release(text, want):
    assert parse_release(text) == want


@pytest.fixture
def fake_vllm(monkeypatch):
    def install(version):
        monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    return install


@pytest.mark.parametrize("version", ["0.32.0", "0.32.9", "0.33.0", "0.33.2rc1"])
def test_each_end_of_the_range_is_accepted(fake_vllm, version):
    fake_vllm(version)
    assert check_vllm("kvoffload.vllm") in SUPPORTED_RELEASES


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "0.3.3", "main", "0.320.0"])
def test_outside_the_range_is_one_clear_line(fake_vllm, version):
    fake_vllm(version)
    with pytest.raises(ImportError) as e:
        check_vllm("kvoffload.vllm_tier")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"kvoffload.vllm_tier supports vLLM 0.32.x or 0.33.x; the installed vLLM is {version}.")


def test_the_adapters_refuse_an_unsupported_release_at_first_lookup(fake_vllm, monkeypatch):
    import kvoffload.vllm as kvv
    import kvoffload.vllm_tier as tier

    fake_vllm("0.35.0")
    monkeypatch.setattr(kvv, "_CLASSES", {})
    monkeypatch.setattr(tier, "_CLASSES", {})
    with pytest.raises(ImportError, match=r"^kvoffload\.vllm supports vLLM 0\.32\.x or 0\.33\.x; .* is 0\.35\.0\."):
        kvv.KvoffloadConnector
    with pytest.raises(ImportError, match=r"^kvoffload\.vllm_tier supports vLLM .* is 0\.35\.0\."):
        tier.KvoffloadTier
