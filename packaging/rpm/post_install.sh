# gpu-medic RPM %post. $1: 1 = first install, 2 = upgrade. Plain shell: the spec
# scripts/packaging.py writes uses no %systemd_post macro, so this is what that macro does.
# The state directory (systemd's StateDirectory= would also create it at the first start).
install -d -m 0700 /var/lib/gpu-medic
if [ "$1" -eq 1 ] && command -v systemctl >/dev/null 2>&1; then
    # 50-gpu-medic.preset says "enable": the unit starts on the next boot. Nothing is started
    # now: an image build instance may have no GPU.
    systemctl --no-reload preset gpu-medic.service >/dev/null 2>&1 || :
fi
exit 0
