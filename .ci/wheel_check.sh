#!/usr/bin/env bash
# The wheel as an operator gets it: built from this checkout, installed into a fresh
# venv, then run where no C compiler and no OpenSSL headers can be found (a private
# mount namespace hides them; where one cannot be made, a PATH without a compiler and
# CC pointing nowhere), from a directory outside the checkout, with an empty HOME.
# It must take the native path, move exact bytes, and leave nothing under HOME.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m pip wheel "$root" --no-deps -q -w "$work/dist"
python -m venv "$work/venv"
"$work/venv/bin/pip" install -q 'torch==2.13.0' "$work"/dist/kvoffload-*.whl
mkdir -p "$work/home" "$work/run"
cat > "$work/run/check.py" <<'PY'
import os, shutil, subprocess, sys
for tool in ("cc", "gcc", "clang"):
    assert shutil.which(tool) is None, f"{tool} is still on PATH"
assert not os.path.exists("/usr/include/openssl/evp.h") or os.environ.get("KVO_NO_NAMESPACE"), "OpenSSL headers visible"
out = subprocess.run([sys.executable, "-m", "kvoffload", "--mib", "64"], capture_output=True, text=True)
print(out.stdout, out.stderr, sep="")
assert out.returncode == 0, out.returncode
assert "IO path: native (" in out.stdout, "the wheel did not take the native path"
assert "bytes verified: True" in out.stdout
import kvoffload
assert not kvoffload.__file__.startswith(os.environ["KVO_ROOT"]), f"imported from the checkout: {kvoffload.__file__}"
home = os.environ["HOME"]
left = [os.path.join(d, f) for d, _, fs in os.walk(home) for f in fs]
assert not left, f"files appeared under HOME: {left}"
print("wheel check: native path, exact bytes, nothing written under HOME; kvoffload from", kvoffload.__file__)
PY
run() {  # $1: PATH, $2: what the check runs under
  env -i HOME="$work/home" XDG_CACHE_HOME="$work/home/.cache" PATH="$1" CC=/nonexistent/cc \
    KVO_ROOT="$root" KVO_NO_NAMESPACE="${KVO_NO_NAMESPACE:-}" bash -c "cd '$work/run' && $2 python check.py"
}
# Hide the compilers and the headers: an empty tmpfs over /usr/include, and /dev/null (which
# cannot be run) bound over each compiler.
hide='mount -t tmpfs none /usr/include && for c in /usr/bin/cc /usr/bin/gcc /usr/bin/c99 /usr/bin/x86_64-linux-gnu-gcc* /usr/bin/clang*; do [ -e "$c" ] && mount --bind /dev/null "$c"; done;'
if unshare --mount true 2>/dev/null; then
  run "$work/venv/bin:/usr/bin:/bin" "unshare --mount sh -c '$hide exec \"\$0\" \"\$@\"'"
else
  echo "wheel check: no mount namespace here; compilers hidden from PATH only" >&2
  mkdir "$work/bin"
  for t in python3 sh bash env; do ln -s "$(command -v $t)" "$work/bin/$t"; done
  KVO_NO_NAMESPACE=1 run "$work/venv/bin:$work/bin" ""
fi
# A source install where no C compiler works still installs, and runs the Python path saying why
# (from the tracked files alone: no build directory or extension left by an earlier build).
mkdir "$work/src" && (cd "$root" && git ls-files -z | xargs -0 cp --parents -t "$work/src")
python -m venv "$work/venv-nocc"
"$work/venv-nocc/bin/pip" install -q 'torch==2.13.0' 'setuptools>=61' 'cffi>=1.17'
( cd "$work/run" && CC=/nonexistent/cc "$work/venv-nocc/bin/pip" install -q --no-build-isolation "$work/src" ) \
  > "$work/nocc.log" 2>&1 || { tail -20 "$work/nocc.log"; echo "wheel check: the source install failed" >&2; exit 1; }
out=$(cd "$work/run" && "$work/venv-nocc/bin/python" -m kvoffload --mib 16 2>&1)
echo "$out" | tail -2
echo "$out" | grep -q "IO path: Python (the native IO core was not built with this install" \
  || { echo "wheel check: a source install without a compiler did not say it runs the Python path" >&2; exit 1; }
echo "$out" | grep -q "bytes verified: True" || { echo "wheel check: the Python path's round trip failed" >&2; exit 1; }
echo "wheel check: a source install with no working compiler installs and runs the Python path, saying why"

