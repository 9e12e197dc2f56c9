#!/usr/bin/env bash
# Stop a moto_server started by tests/support/start-moto.sh.  Usage: stop-moto.sh PIDFILE
# Sends SIGTERM, waits up to 5 s, then SIGKILL; removes PIDFILE. No-op if it is not running.
set -euo pipefail
pidfile="${1:?usage: $0 PIDFILE}"
[ -f "$pidfile" ] || exit 0
pid="$(cat "$pidfile")"
if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
fi
rm -f "$pidfile"
