"""AES-128-GCM speed, one thread: kvoffload's native kvo_gcm_seal/open against
``cryptography``'s AESGCM.encrypt_into/decrypt_into (OpenSSL), on the same buffers.

    python scripts/bench_aes_gcm.py [--impl NAME|all] [--rounds N] [--sizes 2M,256K,64K]

The core's functions come from the built extension ``kvoffload.native_engine._core``, called as the
backend calls them (cffi, API mode). Every case runs once per round, the rounds in
rotating order (so drift and noise from other tenants spread over all cases alike);
each sample is about --sample-s seconds of back-to-back calls on one buffer (short
samples, many rounds: a sample that another process interrupts is an outlier the
median drops, not a bias on every sample). Printed per case: the median GiB/s over the
rounds and its range (min-max), the median CPU seconds per GiB (the thread's CPU time,
so time this thread was not run is left out), and against cryptography the median
and range of the per-round ratios (each round's rate over cryptography's, same size and
direction, same round). cryptography has no in-place form, so its rows are out of place.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

IMPLS = ("vaes-avx512", "vaes-avx2", "aesni-pclmul")


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)


def human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default="best", help="a path name, 'best' (the CPU's pick) or 'all' it supports")
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--sample-s", type=float, default=0.025)
    ap.add_argument("--sizes", default="2M,256K,64K")
    ap.add_argument("--aad", type=int, default=32, help="AAD bytes per call")
    args = ap.parse_args()

    from cryptography import __version__ as crypto_version
    from cryptography.hazmat.backends.openssl import backend
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from kvoffload import native_engine

    core = native_engine.core()
    if core is None:
        sys.exit(f"the native IO core is unavailable: {native_engine.why_unavailable()}")
    ffi, lib, where = core.ffi, core.lib, "kvoffload.native_engine._core"
    if not lib.kvo_gcm_supported():
        sys.exit("kvo_gcm_supported() is 0 on this CPU")
    best = ffi.string(lib.kvo_gcm_impl()).decode()
    if args.impl == "best":
        impls = [best]
    elif args.impl == "all":
        impls = [i for i in IMPLS if lib.kvo_gcm_force_impl(i.encode()) == 0]
    else:
        impls = [args.impl]
    for i in impls:
        if lib.kvo_gcm_force_impl(i.encode()) != 0:
            sys.exit(f"this CPU cannot run path {i}")
    lib.kvo_gcm_force_impl(ffi.NULL)

    key, nonce, aad = os.urandom(16), os.urandom(12), os.urandom(args.aad)
    aes = AESGCM(key)
    k = ffi.new("kvo_gcm_key *")
    lib.kvo_gcm_init(k, key)
    sizes = [parse_size(s) for s in args.sizes.split(",")]

    cases = []  # (size, label, fn): fn(n) runs n calls
    for size in sizes:
        pt = bytearray(os.urandom(size))
        ct = bytearray(size + 16)  # cryptography's layout: ciphertext || tag
        aes.encrypt_into(nonce, pt, aad, ct)
        back = bytearray(size)
        cpt, cct, cback = ffi.from_buffer(pt), ffi.from_buffer(ct), ffi.from_buffer(back)
        sealed = ffi.new("uint8_t[]", size)
        tag = ffi.new("uint8_t[16]")
        ctag = ffi.new("uint8_t[16]", bytes(ct[size:]))
        inplace = ffi.new("uint8_t[]", size)

        def c_enc(n, pt=pt, ct=ct):
            for _ in range(n):
                aes.encrypt_into(nonce, pt, aad, ct)

        def c_dec(n, ct=ct, back=back):
            for _ in range(n):
                aes.decrypt_into(nonce, ct, aad, back)

        cases.append((size, "cryptography encrypt_into", c_enc))
        cases.append((size, "cryptography decrypt_into", c_dec))
        for impl in impls:
            bimpl = impl.encode()

            def seal_oop(n, cpt=cpt, sealed=sealed, tag=tag, size=size, bimpl=bimpl):
                lib.kvo_gcm_force_impl(bimpl)
                for _ in range(n):
                    lib.kvo_gcm_seal(k, nonce, aad, len(aad), cpt, sealed, size, tag)

            def open_oop(n, cct=cct, cback=cback, ctag=ctag, size=size, bimpl=bimpl):
                lib.kvo_gcm_force_impl(bimpl)
                for _ in range(n):
                    if lib.kvo_gcm_open(k, nonce, aad, len(aad), cct, cback, size, ctag) != 0:
                        raise SystemExit("open failed: tag mismatch against cryptography's ciphertext")

            def seal_ip(n, buf=inplace, tag=tag, size=size, bimpl=bimpl):
                lib.kvo_gcm_force_impl(bimpl)
                for _ in range(n):  # each call encrypts the previous call's output: same work
                    lib.kvo_gcm_seal(k, nonce, aad, len(aad), buf, buf, size, tag)

            def open_ip(n, buf=inplace, tag=tag, size=size, bimpl=bimpl):
                lib.kvo_gcm_force_impl(bimpl)
                for _ in range(n):  # the tag check fails after the first call: same work
                    lib.kvo_gcm_open(k, nonce, aad, len(aad), buf, buf, size, tag)

            cases.append((size, f"{impl} seal, out of place", seal_oop))
            cases.append((size, f"{impl} open, out of place", open_oop))
            cases.append((size, f"{impl} seal, in place", seal_ip))
            cases.append((size, f"{impl} open, in place", open_ip))

    # Calls per sample: calibrated once per case to about --sample-s.
    calls = []
    for size, _, fn in cases:
        fn(3)
        n, t = 4, 0.0
        while True:
            t0 = time.perf_counter()
            fn(n)
            t = time.perf_counter() - t0
            if t > args.sample_s / 4:
                break
            n *= 2
        calls.append(max(1, int(n * args.sample_s / t)))

    rate = [[] for _ in cases]
    cpu = [[] for _ in cases]
    for r in range(args.rounds):
        order = list(range(len(cases)))
        shift = (r * 7) % len(order)
        order = order[shift:] + order[:shift]
        if r % 2:
            order.reverse()
        for i in order:
            size, _, fn = cases[i]
            n = calls[i]
            c0, t0 = time.thread_time(), time.perf_counter()
            fn(n)
            t1, c1 = time.perf_counter(), time.thread_time()
            gib = n * size / (1 << 30)
            rate[i].append(gib / (t1 - t0))
            cpu[i].append((c1 - c0) / gib)
    lib.kvo_gcm_force_impl(ffi.NULL)

    print(f"cryptography {crypto_version} ({backend.openssl_version_text()}); kvo_gcm from {where}, "
          f"CPU's path {best}; one thread, AAD {args.aad} B, {args.rounds} rounds x ~{args.sample_s} s a case")
    print(f"{'size':>8}  {'case':<34} {'GiB/s median':>12}  {'range':>13}  {'CPU s/GiB':>9}  "
          f"{'vs cryptography (range)':>24}")
    for j, (size, label, _) in enumerate(cases):
        med = statistics.median(rate[j])
        ref_label = "cryptography decrypt_into" if " open" in label or "decrypt" in label else "cryptography encrypt_into"
        ref = next(i for i, c in enumerate(cases) if c[0] == size and c[1] == ref_label)
        vs = ""
        if ref != j:
            ratios = [a / b for a, b in zip(rate[j], rate[ref])]
            vs = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"{human(size):>8}  {label:<34} {med:12.2f}  {min(rate[j]):6.2f}-{max(rate[j]):<6.2f}"
              f"  {statistics.median(cpu[j]):9.4f}  {vs:>24}")

if __name__ == "__main__":
    main()
