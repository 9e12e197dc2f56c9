#!/usr/bin/env python3
"""The daemon speaks systemd's notify protocol as gpu-medic.service expects (Type=notify,
NotifyAccess=main, WatchdogSec=): run `gpu-medic run` with a NOTIFY_SOCKET this script binds,
and check that READY=1 comes, that WATCHDOG=1 keeps coming, that every message comes from the
main process (NotifyAccess=main drops the others), and that SIGTERM gives STOPPING=1, exit 0
and a saved state.json.

    python3 scripts/packaging-notify-test.py [--wrap 'setpriv ...'] /usr/bin/gpu-medic POLICY

--wrap runs the binary under a command prefix (scripts/packaging-check.sh uses setpriv to give
it only the unit's capability bounding set and no_new_privs). With a wrapper that execs, the
main pid is still the child's pid. Probes and AWS are off in the config used here: this is the
protocol, not the probes.
"""

import argparse
import os
import shlex
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wrap", default="")
    ap.add_argument("binary")
    ap.add_argument("policy")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="gpu-medic-notify-"))
    cfg = tmp / "config.toml"
    cfg.write_text(
        f"""state_dir = "{tmp / 'state'}"
policy = "{a.policy}"
tick_interval = "200ms"
[nvml]
enabled = false
[mps]
enabled = false
[aws]
enabled = false
"""
    )
    sock_path = tmp / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.settimeout(0.2)

    env = dict(os.environ, NOTIFY_SOCKET=str(sock_path), GPU_MEDIC_LOG="info")
    env.pop("WATCHDOG_USEC", None)
    cmd = shlex.split(a.wrap) + [a.binary, "run", "--config", str(cfg), "--log-format", "text"]
    log = open(tmp / "daemon.log", "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    messages: list[tuple[float, int, str]] = []

    def receive(until: float, want) -> bool:
        while time.monotonic() < until:
            try:
                data, anc, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except socket.timeout:
                if proc.poll() is not None and not want(messages):
                    return False
                continue
            pid = -1
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("iII", payload[:12])[0]
            for line in data.decode().splitlines():
                messages.append((time.monotonic(), pid, line))
            if want(messages):
                return True
        return want(messages)

    errors: list[str] = []
    t0 = time.monotonic()
    ready = receive(t0 + 20, lambda m: any(x[2] == "READY=1" for x in m))
    if not ready:
        errors.append("no READY=1 within 20 s")
    else:
        ready_at = next(t for t, _, x in messages if x == "READY=1")
        ok = receive(
            time.monotonic() + 5,
            lambda m: sum(1 for t, _, x in m if x == "WATCHDOG=1" and t >= ready_at) >= 3,
        )
        if not ok:
            errors.append("fewer than 3 WATCHDOG=1 within 5 s of READY=1 (tick 200 ms)")
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        receive(time.monotonic() + 30, lambda m: proc.poll() is not None)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            errors.append("still running 30 s after SIGTERM")
        # Drain what is left.
        receive(time.monotonic() + 0.5, lambda m: False)
        if rc != 0:
            errors.append(f"exit status {rc} after SIGTERM (want 0)")
    else:
        errors.append(f"daemon exited early with {proc.returncode}")
    if not any(x == "STOPPING=1" for _, _, x in messages):
        errors.append("no STOPPING=1 after SIGTERM")
    strangers = {pid for _, pid, _ in messages if pid != proc.pid}
    if strangers:
        errors.append(f"messages from pid(s) {sorted(strangers)}, not the main pid {proc.pid} (NotifyAccess=main drops them)")
    if not (tmp / "state" / "state.json").is_file():
        errors.append("no state.json after a graceful stop")

    kinds = {}
    for _, _, x in messages:
        kinds[x] = kinds.get(x, 0) + 1
    if errors:
        log.seek(0)
        sys.stderr.write(log.read()[-4000:])
        for e in errors:
            print(f"packaging-notify-test: {e}", file=sys.stderr)
        print(f"packaging-notify-test: received {kinds}", file=sys.stderr)
        return 1
    print(f"packaging-notify-test: ok, received {kinds} from pid {proc.pid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
