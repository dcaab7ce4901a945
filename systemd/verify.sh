#!/usr/bin/env bash
# Verify the relay systemd units offline with systemd-analyze.
#
#   bash systemd/verify.sh
#
# `systemd-analyze verify` fails when ExecStart's binary is missing, and
# /opt/relay/bin/relay exists only on an installed host. So the units are copied
# to a temporary directory with ExecStart pointing at an existing binary (true);
# every other line is checked as written. Unknown keys and bad values are only
# warnings to systemd-analyze (exit 0), so any output that names a unit is an
# error here. User=relay needs no such user: verify does not resolve users.
#
# Also checks the hardening with `systemd-analyze security --offline` against a
# threshold, so a removed sandboxing line fails too.
#
# Exit status: 0 all good (or systemd-analyze absent: skipped), 1 otherwise.
set -euo pipefail

if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "systemd-analyze not found, skipping"
    exit 0
fi

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
units=(relay-outbox.service relay-inbox.service)
# Highest exposure allowed, in tenths as `security --threshold` takes it:
# 30 = the "3.0" that systemd-analyze prints (0.0 = locked down, 10.0 = none).
threshold="${RELAY_SYSTEMD_EXPOSURE_THRESHOLD:-30}"
shown="$((threshold / 10)).$((threshold % 10))"

true_bin="$(type -P true)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

for unit in "${units[@]}"; do
    src="$here/$unit"
    if [[ ! -f "$src" ]]; then
        echo "FAIL: $src is missing" >&2
        exit 1
    fi
    if ! grep -q '^ExecStart=/opt/relay/bin/relay ' "$src"; then
        echo "FAIL: $unit: expected 'ExecStart=/opt/relay/bin/relay …'" >&2
        exit 1
    fi
    sed "s|^ExecStart=/opt/relay/bin/relay |ExecStart=$true_bin |" "$src" > "$tmp/$unit"
done

echo "systemd-analyze: $(systemd-analyze --version | head -n1)"
echo "verifying copies in $tmp with ExecStart=$true_bin …"

status=0
out="$(cd "$tmp" && systemd-analyze verify --man=no --recursive-errors=no "${units[@]}" 2>&1)" || status=$?
# Lines about our units (by file name or unit name) are errors; anything else
# (e.g. about the host's own units) is shown but does not fail the check.
ours="$(printf '%s\n' "$out" | grep -E 'relay-(outbox|inbox)\.service' || true)"
if [[ -n "$out" ]]; then
    printf '%s\n' "$out"
fi
if [[ $status -ne 0 || -n "$ours" ]]; then
    echo "FAIL: systemd-analyze verify reported problems (exit $status)" >&2
    exit 1
fi
echo "OK: systemd-analyze verify: ${units[*]}"

for unit in "${units[@]}"; do
    # --threshold makes the command fail when the exposure level is above it.
    if ! sec="$(cd "$tmp" && systemd-analyze security --offline=yes --threshold="$threshold" "$unit" 2>&1)"; then
        printf '%s\n' "$sec" | grep -v '✓' >&2 || true
        echo "FAIL: $unit: exposure level above $shown" >&2
        exit 1
    fi
    printf '%s\n' "$sec" | grep 'Overall exposure level' || true
done
echo "OK: systemd-analyze security: exposure at or below $shown"
