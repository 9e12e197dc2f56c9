# gpu-medic RPM %preun. $1: 0 = erase, 1 = upgrade. On erase: stop (gracefully: state is saved)
# and disable. On upgrade the running daemon is left alone until %postun.
if [ "$1" -eq 0 ] && command -v systemctl >/dev/null 2>&1; then
    systemctl --no-reload disable --now gpu-medic.service >/dev/null 2>&1 || :
fi
exit 0
