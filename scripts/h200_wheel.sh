# Sourced (from the repository root) by the H200 scripts that test the carried wheel:
# installs .whl (the kvoffload wheel, cryptography, cffi, pycparser; COMMIT) into /tmp/site
# and records the build in $OUT/env.txt. `wheel_only` moves the checkout's kvoffload/ aside
# (so the wheel's is the one imported) and names the core it loads; `checkout_back` puts it
# back (so does the exit trap).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
echo "build: $(cat .whl/COMMIT 2>/dev/null)" > "$OUT/env.txt"

wheel_only() {
  mv kvoffload /tmp/kvoffload.checkout
  trap 'mv /tmp/kvoffload.checkout kvoffload 2>/dev/null' EXIT
  PYTHONPATH=/tmp/site python3 -c "import kvoffload, kvoffload.native_io as n; print('wheel:', kvoffload.__file__, n.core().describe())" \
    | tee -a "$OUT/env.txt"
}

checkout_back() {
  mv /tmp/kvoffload.checkout kvoffload
  trap - EXIT
}
