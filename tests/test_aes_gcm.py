"""kvoffload's AES-128-GCM (kvoffload/native/aes_gcm.c) against ``cryptography``'s AESGCM.

Every check runs once for each code path this CPU can take (kvo_gcm_force_impl), so
the fallbacks are tested here even where the CPU picks the fast path: published
vectors (McGrew-Viega test cases 1-4, IEEE 802.1AE's 60-byte ones), then random keys,
nonces, AAD and payload lengths in place and out of place, each direction against the
other side, bit flips that must fail the open, and property-based cases (hypothesis).
"""

from __future__ import annotations

import os

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PATHS = ("vaes-avx512", "vaes-avx2", "aesni-pclmul")
TAG = 16


@pytest.fixture(scope="session")
def native(native_core):
    """The built extension: ``ffi`` and ``lib`` with the kvo_gcm_* functions."""
    return native_core


@pytest.fixture(params=PATHS)
def gcm(request, native):
    """A Gcm on one forced code path (skipped where this CPU cannot run it)."""
    lib = native.lib
    if not lib.kvo_gcm_supported():
        pytest.skip("kvo_gcm_supported() is 0: no AES-NI/PCLMULQDQ here")
    if lib.kvo_gcm_force_impl(request.param.encode()) != 0:
        pytest.skip(f"this CPU cannot run path {request.param}")
    assert native.ffi.string(lib.kvo_gcm_impl()).decode() == request.param
    yield Gcm(native.ffi, lib)
    assert lib.kvo_gcm_force_impl(native.ffi.NULL) == 0


class Gcm:
    """seal/open over bytes, with the output between guard bytes that must not change."""

    GUARD = 67  # odd, so the payload sits at an unaligned address

    def __init__(self, ffi, lib) -> None:
        self.ffi, self.lib = ffi, lib

    def key(self, key: bytes, offset: int = 0):
        """The expanded key, at `offset` bytes into its own buffer (cffi gives 16-byte
        alignment, not the type's 64; other offsets check nothing assumes more)."""
        n = self.ffi.sizeof("kvo_gcm_key")
        buf = self.ffi.new("uint8_t[]", n + 128)
        addr = int(self.ffi.cast("uintptr_t", buf))
        k = self.ffi.cast("kvo_gcm_key *", buf + ((-addr) % 64) + offset)
        self.lib.kvo_gcm_init(k, key)
        return k, buf  # keep buf alive with k

    def _run(self, fn, key: bytes, nonce: bytes, aad: bytes, data: bytes, inplace: bool, tag: bytes | None):
        k, _keep = self.key(key)
        g = self.GUARD
        n = len(data)
        buf = bytearray(os.urandom(g) + (data if inplace else os.urandom(n)) + os.urandom(g))
        before = bytes(buf)
        cbuf = self.ffi.from_buffer(buf)
        if inplace:
            src, dst = cbuf + g, cbuf + g
        else:
            srcb = bytearray(os.urandom(g) + data)  # input at its own odd offset
            src, dst = self.ffi.from_buffer(srcb) + g, cbuf + g
        aadb = self.ffi.from_buffer(bytearray(aad + b"\0"))  # never a NULL pointer, even for b""
        t = self.ffi.new("uint8_t[16]", tag if tag is not None else bytes(16))
        rc = fn(k, nonce, aadb, len(aad), src, dst, n, t)
        assert bytes(buf[:g]) == before[:g] and bytes(buf[g + n:]) == before[g + n:], "wrote outside out[0..len)"
        return rc, bytes(buf[g:g + n]), bytes(self.ffi.buffer(t))

    def seal(self, key: bytes, nonce: bytes, aad: bytes, pt: bytes, inplace: bool = False) -> bytes:
        """ciphertext || tag, as AESGCM.encrypt returns it."""
        _, ct, tag = self._run(self.lib.kvo_gcm_seal, key, nonce, aad, pt, inplace, None)
        return ct + tag

    def open(self, key: bytes, nonce: bytes, aad: bytes, sealed: bytes, inplace: bool = False) -> tuple[int, bytes]:
        """(0 or -1, the bytes written), the input being ciphertext || tag."""
        rc, pt, _ = self._run(self.lib.kvo_gcm_open, key, nonce, aad, sealed[:-TAG], inplace, sealed[-TAG:])
        return rc, pt


# McGrew and Viega, "The Galois/Counter Mode of Operation (GCM)", test cases 1-4
# (AES-128, 96-bit IV); IEEE 802.1AE (MACsec) GCM-AES-128 vectors: 2.3.1 "60-byte packet
# authentication" (all 60 bytes AAD, no payload) and 2.2.1 "60-byte packet encryption".
_P3 = ("d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a72"
       "1c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b391aafd255")
_C3 = ("42831ec2217774244b7221b784d0d49ce3aa212f2c02a4e035c17e2329aca12e"
       "21d514b25466931c7d8f6a5aac84aa051ba30b396a0aac973d58e091473f5985")
VECTORS = {
    "gcm-tc1": ("00" * 16, "00" * 12, "", "", "58e2fccefa7e3061367f1d57a4e7455a"),
    "gcm-tc2": ("00" * 16, "00" * 12, "", "00" * 16,
                "0388dace60b6a392f328c2b971b2fe78" "ab6e47d42cec13bdf53a67b21257bddf"),
    "gcm-tc3": ("feffe9928665731c6d6a8f9467308308", "cafebabefacedbaddecaf888", "", _P3,
                _C3 + "4d5c2af327cd64a62cf35abd2ba6fab4"),
    "gcm-tc4": ("feffe9928665731c6d6a8f9467308308", "cafebabefacedbaddecaf888",
                "feedfacedeadbeeffeedfacedeadbeefabaddad2", _P3[:120],
                _C3[:120] + "5bc94fbc3221a5db94fae95ae7121a47"),
    "macsec-2.3.1-60-byte-auth": (
        "071b113b0ca743fecccf3d051f737382", "f0761e8dcd3d000176d457ed",
        "e20106d7cd0df0761e8dcd3d88e5400076d457ed08000f101112131415161718191a1b1c"
        "1d1e1f202122232425262728292a2b2c2d2e2f303132333435363738393a0003",
        "", "0c017bc73b227dfcc9bafa1c41acc353"),
    "macsec-2.2.1-60-byte-crypt": (
        "ad7a2bd03eac835a6f620fdcb506b345", "12153524c0895e81b2c28465",
        "d609b1f056637a0d46df998d88e52e00b2c2846512153524c0895e81",
        "08000f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f303132333435363738393a0002",
        "701afa1cc039c0d765128a665dab69243899bf7318ccdc81c9931da17fbe8edd7d17cb8b4c26fc81e3284f2b7fba713d"
        "4f8d55e7d3f06fd5a13c0c29b9d5b880"),
}

AAD_LENS = (0, 1, 8, 15, 16, 17, 100)
# The brief's lengths, and the edges of each path's loops: the xmm path's first step
# (6 blocks before it, 128-byte steps: 352), the ymm path's (14 blocks, 256: 736) and
# the zmm path's (30 blocks, 512-byte steps: 992, and one more step at 1504).
PAYLOAD_LENS = (0, 1, 15, 16, 17, 255, 256, 257, 351, 352, 353, 735, 736, 737, 991, 992, 993, 1504, 1505,
                4095, 4096 + 5, 65536 + 3, 2 << 20)


def unhex(*parts: str) -> list[bytes]:
    return [bytes.fromhex(p) for p in parts]


def test_the_cpu_path_is_named(native) -> None:
    lib, ffi = native.lib, native.ffi
    name = ffi.string(lib.kvo_gcm_impl()).decode()
    if not lib.kvo_gcm_supported():
        assert name == "none"
        pytest.skip("no AES-NI/PCLMULQDQ here")
    assert name in PATHS
    assert lib.kvo_gcm_force_impl(b"no-such-path") == -1
    assert lib.kvo_gcm_force_impl(b"auto") == 0 and ffi.string(lib.kvo_gcm_impl()).decode() == name


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_published_vectors(gcm, name) -> None:
    key, nonce, aad, pt, sealed = unhex(*VECTORS[name])
    assert AESGCM(key).encrypt(nonce, pt, aad) == sealed  # the vector as transcribed
    for inplace in (False, True):
        assert gcm.seal(key, nonce, aad, pt, inplace) == sealed
        assert gcm.open(key, nonce, aad, sealed, inplace) == (0, pt)


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "in-place"])
@pytest.mark.parametrize("n", PAYLOAD_LENS)
def test_matches_cryptography_both_ways(gcm, n, inplace) -> None:
    pt = os.urandom(n)
    for aad_len in AAD_LENS:
        key, nonce, aad = os.urandom(16), os.urandom(12), os.urandom(aad_len)
        ref = AESGCM(key)
        mine = gcm.seal(key, nonce, aad, pt, inplace)
        assert mine == ref.encrypt(nonce, pt, aad), f"seal differs: payload {n}, aad {aad_len}"
        assert ref.decrypt(nonce, mine, aad) == pt  # ours seals, cryptography opens
        theirs = ref.encrypt(nonce, pt, aad)
        assert gcm.open(key, nonce, aad, theirs, inplace) == (0, pt)  # and the reverse


@pytest.mark.parametrize("n", [0, 1, 17, 256, 993, 4096 + 5])
def test_any_flipped_bit_fails_the_open(gcm, n) -> None:
    key, nonce, aad = os.urandom(16), os.urandom(12), os.urandom(24)
    pt = os.urandom(n)
    sealed = gcm.seal(key, nonce, aad, pt)
    assert gcm.open(key, nonce, aad, sealed) == (0, pt)

    def flip(b: bytes, i: int, bit: int = 0) -> bytes:
        out = bytearray(b)
        out[i] ^= 1 << bit
        return bytes(out)

    for i in sorted({0, n // 2, n - 1}) if n else []:  # ciphertext: first, middle, last byte
        for bit in (0, 7):
            assert gcm.open(key, nonce, aad, flip(sealed, i, bit))[0] == -1
    for i in (n, n + 7, n + 15):  # tag
        assert gcm.open(key, nonce, aad, flip(sealed, i, 3))[0] == -1
    for i in (0, len(aad) - 1):  # AAD
        assert gcm.open(key, nonce, flip(aad, i, 5), sealed)[0] == -1
    assert gcm.open(key, nonce, aad + b"\0", sealed)[0] == -1  # AAD one byte longer
    for i in (0, 11):  # nonce
        assert gcm.open(key, flip(nonce, i, 1), aad, sealed)[0] == -1
    assert gcm.open(flip(key, 9), nonce, aad, sealed)[0] == -1  # another key


def test_open_of_a_bad_tag_still_writes_the_plaintext(gcm) -> None:
    """The documented contract: -1, with the (unverified) plaintext in out; the caller
    zeroes it."""
    key, nonce, aad, pt = os.urandom(16), os.urandom(12), b"hdr", os.urandom(1000)
    sealed = bytearray(gcm.seal(key, nonce, aad, pt))
    sealed[-1] ^= 1
    assert gcm.open(key, nonce, aad, bytes(sealed)) == (-1, pt)


@pytest.mark.parametrize("offset", [0, 4, 8, 16, 32, 48])
def test_the_expanded_key_needs_no_alignment(gcm, offset) -> None:
    key, nonce, aad, pt = os.urandom(16), os.urandom(12), os.urandom(40), os.urandom(3000)
    k, _keep = gcm.key(key, offset)
    out = gcm.ffi.new("uint8_t[]", len(pt))
    tag = gcm.ffi.new("uint8_t[16]")
    gcm.lib.kvo_gcm_seal(k, nonce, aad, len(aad), pt, out, len(pt), tag)
    assert bytes(gcm.ffi.buffer(out)) + bytes(gcm.ffi.buffer(tag)) == AESGCM(key).encrypt(nonce, pt, aad)


def test_one_key_serves_many_messages(gcm) -> None:
    key = os.urandom(16)
    k, _keep = gcm.key(key)
    ref = AESGCM(key)
    for i in range(50):
        nonce, aad, pt = os.urandom(12), os.urandom(i % 20), os.urandom(i * 97)
        out = gcm.ffi.new("uint8_t[]", max(1, len(pt)))
        tag = gcm.ffi.new("uint8_t[16]")
        gcm.lib.kvo_gcm_seal(k, nonce, aad, len(aad), pt, out, len(pt), tag)
        assert bytes(gcm.ffi.buffer(out, len(pt))) + bytes(gcm.ffi.buffer(tag)) == ref.encrypt(nonce, pt, aad)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.binary(min_size=16, max_size=16), nonce=st.binary(min_size=12, max_size=12),
       aad=st.binary(max_size=300), pt=st.binary(max_size=5000), inplace=st.booleans())
def test_property_matches_cryptography(gcm, key, nonce, aad, pt, inplace) -> None:
    sealed = AESGCM(key).encrypt(nonce, pt, aad)
    assert gcm.seal(key, nonce, aad, pt, inplace) == sealed
    assert gcm.open(key, nonce, aad, sealed, inplace) == (0, pt)
    with pytest.raises(InvalidTag):
        AESGCM(key).decrypt(nonce, sealed[:-1] + bytes([sealed[-1] ^ 0x80]), aad)
    assert gcm.open(key, nonce, aad, sealed[:-1] + bytes([sealed[-1] ^ 0x80]), inplace)[0] == -1
