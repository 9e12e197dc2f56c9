#!/usr/bin/env bash
# Start moto_server (from .ci/install-deps.sh's venv) on 127.0.0.1 in the background.
#
# Usage: tests/support/start-moto.sh PIDFILE [PORT]
#   PORT defaults to a free port picked by the kernel.
#   Prints the endpoint URL (e.g. http://127.0.0.1:5000) on stdout once moto answers.
#   Writes moto's pid to PIDFILE; its log goes to PIDFILE.log.
#   Stop it with: tests/support/stop-moto.sh PIDFILE   (or: kill "$(cat PIDFILE)")
# Env: GPU_MEDIC_CI_VENV (default /opt/gpu-medic-ci/venv), MOTO_START_TIMEOUT (seconds, default 30)
set -euo pipefail

pidfile="${1:?usage: $0 PIDFILE [PORT]}"
port="${2:-}"
venv="${GPU_MEDIC_CI_VENV:-/opt/gpu-medic-ci/venv}"
py="$venv/bin/python"
[ -x "$venv/bin/moto_server" ] || { echo "moto_server not found in $venv; run .ci/install-deps.sh" >&2; exit 1; }

# Bind-test the port (or let the kernel pick one): otherwise a busy port would be "ready" at once
# because another server answers, while our moto_server dies on bind.
port="$("$py" -c '
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try: s.bind(("127.0.0.1", int(sys.argv[1] or 0)))
except OSError as e: sys.exit("port %s: %s" % (sys.argv[1], e))
print(s.getsockname()[1])' "$port")"
url="http://127.0.0.1:$port"

# setsid: own session, so the caller's job control / Ctrl-C does not reach it.
setsid "$venv/bin/moto_server" -H 127.0.0.1 -p "$port" </dev/null >"$pidfile.log" 2>&1 &
pid=$!
echo "$pid" >"$pidfile"

deadline=$(( $(date +%s) + ${MOTO_START_TIMEOUT:-30} ))
until "$py" -c 'import sys,urllib.request; urllib.request.urlopen(sys.argv[1]+"/moto-api/", timeout=1)' "$url" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "moto_server exited early; log $pidfile.log:" >&2; cat "$pidfile.log" >&2; rm -f "$pidfile"; exit 1
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
        echo "moto_server did not answer on $url in time; log $pidfile.log" >&2
        kill "$pid" 2>/dev/null || true; rm -f "$pidfile"; exit 1
    fi
    sleep 0.2
done
echo "$url"
