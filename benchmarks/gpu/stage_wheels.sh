#!/usr/bin/env bash
# Run HERE (CPU machine, network to the package registry) before the two GPU calls of docs/gpu.md ("How to run").
# Writes .stage/ (ignored by git; the device tool carries the folders named in `carry`):
#   .stage/common/  the pure-Python wheels the GPU image lacks or has older (transformers 5.24, trl, datasets,
#                   accelerate, liger-kernel ...), carried by BOTH calls (~15 MB);
#   .stage/fa4-1/   part 1 of flash-attn-4 4.0.0b36 and its dependencies (CuTe DSL, ~100 MB of wheels: more than one
#   .stage/fa4-2/   64 MiB carry), installed into a folder, packed as one tar.xz and split into two parts < 40 MiB,
#                   each folder with SHA256SUMS (of both parts and of the whole archive).
# On the machine, benchmarks/gpu/fa4_install.sh stashes part 1 (call 1) and joins, checks and unpacks both (call 2).
# Takes minutes here (xz over ~260 MB: about 4 CPU-minutes). Sizes seen: common 17 MB, each FA4 part 36 MB, the
# tracked tree 8.5 MB: 61.5 MB a call, under the 67.1 MB (64 MiB) a call may carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
EXCLUDE=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.stage/' "$EXCLUDE" 2>/dev/null || echo '/.stage/' >> "$EXCLUDE"
PIP=(python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
COMMON=(transformers==5.24.0 accelerate==1.16.0 trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1
        'fsspec<=2026.9.0' liger-kernel==0.8.5)
FA4=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
     nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2
     torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5)
if [[ "${1:-}" == "--list" ]]; then printf '%s\n' "${COMMON[@]}" "${FA4[@]}"; exit 0; fi
rm -rf .stage && mkdir -p .stage/common .stage/fa4-1 .stage/fa4-2
"${PIP[@]}" -d .stage/common "${COMMON[@]}"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
"${PIP[@]}" -d "$TMP/wheels" "${FA4[@]}"
# installed layout (with dist-info, which transformers' is_flash_attn_4_available reads), as the machine's
# `pip install --target` would make it; unpacked there with tar alone
python3 -m pip install -q --no-deps --no-compile --no-index --target "$TMP/site" --python-version 3.12 \
  --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  "$TMP"/wheels/*.whl
tar -C "$TMP/site" -cf - . | xz -6 -T2 > "$TMP/fa4.tar.xz"
split -n 2 -d "$TMP/fa4.tar.xz" "$TMP/fa4.tar.xz.part-"
mv "$TMP/fa4.tar.xz.part-00" .stage/fa4-1/ && mv "$TMP/fa4.tar.xz.part-01" .stage/fa4-2/
SUMS=$( (cd .stage/fa4-1 && sha256sum fa4.tar.xz.part-00); (cd .stage/fa4-2 && sha256sum fa4.tar.xz.part-01);
        (cd "$TMP" && sha256sum fa4.tar.xz) )
echo "$SUMS" | tee .stage/fa4-1/SHA256SUMS > .stage/fa4-2/SHA256SUMS
du -sh .stage/* && du -sh --apparent-size .stage
echo "tracked + untracked tree: $(git ls-files -z -co --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes"
echo "each call carries .stage/common + one fa4 part + the tree: keep each under 64 MiB (67,108,864 bytes)"
