#!/usr/bin/env bash
# On the GPU machine (run_all.sh calls it): FA4 staged in two parts (benchmarks/gpu/stage_wheels.sh).
#   fa4_install.sh stash    call 1: keep part 1 in /tmp/pf-fa4 (the machine stays up between back-to-back calls)
#   fa4_install.sh install  call 2: join part 1 (from /tmp/pf-fa4, or .stage/fa4-1 if still here) and part 2,
#                           check every SHA-256, unpack into $SITE (default /tmp/site, on PYTHONPATH)
# Exit 0 with one line saying what happened; 3 when FA4 cannot be installed (the benches then use the next kernel).
set -uo pipefail
cd "$(dirname "$0")/../.."
SITE=${SITE:-/tmp/site}; STASH=/tmp/pf-fa4
case "${1:-}" in
  stash)
    mkdir -p "$STASH"
    if [[ -f .stage/fa4-1/fa4.tar.xz.part-00 ]]; then
      cp .stage/fa4-1/fa4.tar.xz.part-00 .stage/fa4-1/SHA256SUMS "$STASH"/ && \
        (cd "$STASH" && grep part-00 SHA256SUMS | sha256sum -c --quiet) && echo "fa4: part 1 stashed in $STASH" && exit 0
    fi
    echo "fa4: no part 1 carried (.stage/fa4-1): FA4 will not be installable in call 2"; exit 3 ;;
  install)
    p1=$STASH/fa4.tar.xz.part-00; [[ -f $p1 ]] || p1=.stage/fa4-1/fa4.tar.xz.part-00
    p2=.stage/fa4-2/fa4.tar.xz.part-01
    if [[ ! -f $p1 || ! -f $p2 ]]; then
      echo "fa4: part 1 ($p1) or part 2 ($p2) missing (a fresh machine between the calls loses part 1): no FA4"
      exit 3
    fi
    work=$(mktemp -d); cp "$p1" "$p2" "$work"/ && cp .stage/fa4-2/SHA256SUMS "$work"/
    (cd "$work" && cat fa4.tar.xz.part-00 fa4.tar.xz.part-01 > fa4.tar.xz && sha256sum -c SHA256SUMS) || {
      echo "fa4: checksum mismatch: no FA4"; exit 3; }
    mkdir -p "$SITE" && tar -C "$SITE" -xJf "$work/fa4.tar.xz" && rm -rf "$work"
    # nvidia_cutlass_dsl_packages.pth adds dsl_packages in a site directory only: run_all.sh puts it on PYTHONPATH
    PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -c \
      "import flash_attn.cute as c; print('fa4: installed', c.__file__)" || { echo "fa4: import failed"; exit 3; }
    ;;
  *) echo "usage: fa4_install.sh stash|install"; exit 2 ;;
esac
