#!/usr/bin/env bash
# Runs every fuzz target for a few seconds (FUZZ_SECONDS, default 5), its corpus seeded from
# tests/fixtures: enough to catch a parser that panics again on inputs like the fixtures. The
# long runs that look for new crashes are by hand (docs/testing.md).
# Needs cargo-fuzz; the sanitizer flags need RUSTC_BOOTSTRAP on a stable toolchain.
set -euo pipefail
cd "$(dirname "$0")"
secs=${FUZZ_SECONDS:-5}
export RUSTC_BOOTSTRAP=1
python3 seed.py
cargo fuzz build -O -a
# cargo fuzz has no --locked: a build that had to change the lock file fails here instead.
git diff --exit-code -- Cargo.lock || { echo "fuzz: core/fuzz/Cargo.lock is out of date"; exit 1; }
log=$(mktemp)
for t in $(cargo fuzz list); do
    if cargo fuzz run -O -a "$t" -- -max_total_time="$secs" -rss_limit_mb=2048 >"$log" 2>&1; then
        echo "fuzz $t: $(grep -Eo 'Done [0-9]+ runs in [0-9]+ second' "$log" | tail -n 1), no crash"
    else
        cat "$log"
        echo "fuzz $t: FAILED (the input is in core/fuzz/artifacts/$t/)"
        exit 1
    fi
done
