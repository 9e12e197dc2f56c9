# gpu-medic RPM %postun. $1: 0 = erase, 1 = upgrade. On upgrade: restart a running daemon on
# the new binary (SIGTERM is a graceful stop; orders in flight resume from state.json).
# systemd's own RPM file trigger runs `systemctl daemon-reload` for the new unit file.
if [ "$1" -ge 1 ] && [ -d /run/systemd/system ]; then
    systemctl try-restart gpu-medic.service >/dev/null 2>&1 || :
fi
exit 0
