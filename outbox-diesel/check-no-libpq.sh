#!/usr/bin/env bash
# Checks that outbox-diesel needs no libpq: no pq-sys in its dependency graph (normal and dev),
# and `ldd` on every test binary of the crate lists no libpq. Run from anywhere; exits non-zero
# with the offending binary or dependency path on failure. Used by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

# `cargo tree -i` fails when pq-sys is in no graph of the workspace, and prints nothing when it
# is elsewhere in the lock file but not under outbox-diesel; either way it is absent here.
tree=$(cargo tree -p txoutbox-diesel -e normal,dev --all-features -i pq-sys 2>/dev/null || true)
if [ -n "$tree" ]; then
    echo "FAIL: pq-sys (libpq) is in outbox-diesel's dependency graph:" >&2
    echo "$tree" >&2
    exit 1
fi
echo "ok: no pq-sys in outbox-diesel's dependency graph"

bins=$(cargo test -p txoutbox-diesel --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"].get("kind") != ["custom-build"]:
        print(m["executable"])')
if [ -z "$bins" ]; then
    echo "FAIL: no test binaries built for outbox-diesel" >&2
    exit 1
fi
status=0
for b in $bins; do
    if ldd "$b" | grep -i 'libpq'; then
        echo "FAIL: $b links libpq" >&2
        status=1
    else
        echo "ok: $(basename "$b") links no libpq"
    fi
done
exit $status
