#!/usr/bin/env bash
# Fetch what the GPU validation kit needs on a lent GPU machine that has no registry access,
# into the ignored folder .gpu-carry/ (run here, on a machine that reaches PyPI and Debian):
#   wheels/  lightgbm and megatron-core for CPython 3.12 manylinux x86_64 (the GPU image has
#            Python 3.12 + torch 2.11 and neither package; their other needs are in the image)
#   debs/    liburing2 + liburing-dev (the C++ core's io_uring backend; unpacked with dpkg -x
#            into a private prefix there) and pkgconf (used there only if it has no pkg-config)
# Prints the device tool's `carry` list and the size of everything that travels against the
# 64 MiB limit (the working tree's tracked + untracked-not-ignored files + the carried folder).
#   scripts/gpu_carry.sh [DEST]          # DEST defaults to .gpu-carry
# Exit codes: 0 fits, 1 over the limit (or a bad pin), 3 a registry did not answer.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${1:-.gpu-carry}
LIMIT_MIB=64
# The versions the project is tested with (requirements/test-env.txt).
pin() { grep -i "^$1==" requirements/test-env.txt | head -1; }
WHEELS=("$(pin lightgbm)" "$(pin megatron-core)")
DEBS=(liburing2 liburing-dev pkgconf pkgconf-bin libpkgconf3)
PIP=${PIP:-python3 -m pip}

for w in "${WHEELS[@]}"; do
  [[ -n "$w" ]] || { echo "gpu_carry: a pin is missing from requirements/test-env.txt" >&2; exit 1; }
done
rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp/wheels" "$DEST.tmp/debs"

echo "gpu_carry: wheels for cp312 manylinux x86_64: ${WHEELS[*]}"
# pip matches manylinux_2_N exactly: name every N the wheels of these versions use.
$PIP download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST.tmp/wheels" "${WHEELS[@]}" || {
  echo "gpu_carry: pip download failed (no package index reachable?)" >&2; exit 3; }

echo "gpu_carry: Debian packages: ${DEBS[*]}"
# apt-get download writes into the current directory; _apt cannot write to root's folders.
(cd "$DEST.tmp/debs" && apt-get download -q "${DEBS[@]}" 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
for d in "${DEBS[@]}"; do
  compgen -G "$DEST.tmp/debs/${d}_*.deb" >/dev/null || {
    echo "gpu_carry: apt-get download did not fetch $d (no Debian mirror reachable, or run" \
      "apt-get update)" >&2; exit 3; }
done

rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
grep -qxF "/$DEST/" .gitignore 2>/dev/null || grep -qxF "$DEST/" .gitignore 2>/dev/null || \
  echo "gpu_carry: warning: $DEST/ is not in .gitignore: it would travel twice" >&2

carry_bytes=$(du -sb "$DEST" | cut -f1)
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | \
  xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s+=$1} END {print s+0}')
total=$((carry_bytes + tree_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
ls -l "$DEST"/wheels "$DEST"/debs | grep -v '^total'
echo "carry: [\"$DEST\"]"
echo "size: carry $(mib "$carry_bytes") MiB + working tree $(mib "$tree_bytes") MiB = $(mib "$total") MiB of ${LIMIT_MIB} MiB"
if ((total > LIMIT_MIB * 1048576)); then
  echo "gpu_carry: over the device tool's ${LIMIT_MIB} MiB limit; largest travelling folders" \
    "(ignore them in .gitignore or .git/info/exclude):" >&2
  git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c '%s %n' -- \
    2>/dev/null | awk '{split($2, p, "/"); s[p[1]] += $1} END {for (k in s) print s[k], k}' | \
    sort -rn | head -5 | awk '{printf "  %8.1f MiB  %s\n", $1 / 1048576, $2}' >&2
  exit 1
fi
