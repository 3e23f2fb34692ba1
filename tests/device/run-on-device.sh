#!/bin/bash
# The device tests on a GPU machine in one prepared run (tests/device/README.md):
#
#   tests/device/run-on-device.sh [OUT]        # OUT: where the figures and logs go
#
# 1. the GPU's state before (nvidia-smi, read-only); 2. what the tests need (Python modules,
# runc, busybox, the CUDA probe), from the system or the carry folder; 3. a gpuhook config
# for this host: driver root (the system's, or one assembled under $WORK from the driver's
# files when the system's ld cache does not list them, as on GKE-like hosts), the host's real
# ldconfig, a reset command that does not exist and kill-orphans off; 4. pytest tests/device
# (the health checks on the real GPU, then real runc containers through the hook: nvidia-smi
# -L and a CUDA context inside, the `none` and no-hook controls, the hook's latency); 5. the
# GPU's state after, which must equal the state before.
#
# Read-only towards the GPU unless GPUHOOK_DEVICE_RESET=1: no reset, no persistence, clock,
# power, compute-mode or MIG change, no kill of anything this script did not start.
# MODE=sim runs it all against `gpuhook simulate` to debug it on a machine without a GPU.
# Needs root. About 1-2 minutes; every step is bounded (the whole run by 5 minutes).
# Exit status: pytest's, or 1 when the GPU's state changed or a step failed.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-${OUT:-/tmp/gpuhook-device/out}}
WORK=${WORK:-/tmp/gpuhook-device}
CARRY=${GPUHOOK_DEVICE_CARRY:-$REPO/tests/device/carry}
MODE=${MODE:-real}
PY=${PY:-$(command -v python3)}
ROUNDS=${GPUHOOK_DEVICE_ROUNDS:-10}
LOGS=$WORK/logs
SUMMARY=$OUT/summary.tsv
START=$(date +%s)
mkdir -p "$OUT" "$LOGS"
: > "$SUMMARY"
status=0
export PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
unset GPUHOOK_CONFIG

# step NAME SECONDS COMMAND...: run it bounded, log to $LOGS/NAME.log, one summary line.
step() {
    local name=$1 limit=$2 begin rc
    shift 2
    begin=$(date +%s%N)
    timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s ms\t%s\n' "$name" "$rc" $(( ($(date +%s%N) - begin) / 1000000 )) \
        "$(tail -n 1 "$LOGS/$name.log" | cut -c1-300)" >> "$SUMMARY"
    echo "== $name: rc=$rc"
    return $rc
}

gpu_state() {  # the settings a read-only run must leave as they were
    if [ "$MODE" = sim ]; then
        $PY -c "import json,sys; s=json.load(open(sys.argv[1])); print([(g['uuid'], g['persistence_mode'], g['mig_mode'], g['reset_count']) for g in s['gpus']])" "$WORK/sim/nvml.json"
    else
        nvidia-smi --query-gpu=uuid,persistence_mode,mig.mode.current,compute_mode,clocks.applications.graphics,power.limit --format=csv,noheader
    fi
}

facts() {
    uname -r; head -2 /etc/os-release; id -u
    if [ "$MODE" = sim ]; then echo "simulated host $WORK/sim"; return 0; fi
    cat /proc/driver/nvidia/version
    nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,driver_version,persistence_mode,mig.mode.current,memory.total,memory.used,memory.reserved --format=csv
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv
    ls -la /sbin/ldconfig* 2>&1
}

tools() {
    # Python modules: the system's, else the wheels carried in $CARRY/wheels, unpacked into a
    # venv (no pip needed: they are pure Python). The hook runs with that venv's python too.
    if ! $PY -c 'import pynvml, pytest' 2>/dev/null; then
        [ -d "$CARRY/wheels" ] || { echo "no pynvml/pytest for $PY and no $CARRY/wheels"; return 1; }
        rm -rf "$WORK/venv"
        $PY -m venv --without-pip --system-site-packages "$WORK/venv" || return 1
        site=$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        for wheel in "$CARRY"/wheels/*.whl; do "$WORK/venv/bin/python" -m zipfile -e "$wheel" "$site" || return 1; done
        echo "PY=$WORK/venv/bin/python" >> "$WORK/env"
    fi
    # runc: the system's, else $CARRY/runc (a binary) or $CARRY/debs/runc.deb (+ libseccomp2.deb).
    if [ -z "${GPUHOOK_DEVICE_RUNC:-}" ] && ! command -v runc >/dev/null; then
        if [ -x "$CARRY/runc" ]; then echo "GPUHOOK_DEVICE_RUNC=$CARRY/runc" >> "$WORK/env"
        elif [ -f "$CARRY/debs/runc.deb" ]; then
            mkdir -p "$WORK/runcx" && dpkg -x "$CARRY/debs/runc.deb" "$WORK/runcx" || return 1
            [ -f "$CARRY/debs/libseccomp2.deb" ] && dpkg -x "$CARRY/debs/libseccomp2.deb" "$WORK/runcx"
            printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$WORK/runcx/usr/lib/x86_64-linux-gnu" \
                "$WORK/runcx/usr/sbin/runc" > "$WORK/runc" && chmod 755 "$WORK/runc"
            echo "GPUHOOK_DEVICE_RUNC=$WORK/runc" >> "$WORK/env"
        else echo "no runc: install it or carry one ($CARRY/runc or $CARRY/debs/runc.deb)"; return 1; fi
    fi
    if [ -z "${GPUHOOK_DEVICE_BUSYBOX:-}" ] && [ ! -e /bin/busybox ] && [ ! -e /usr/bin/busybox ]; then
        if [ -x "$CARRY/busybox" ]; then echo "GPUHOOK_DEVICE_BUSYBOX=$CARRY/busybox" >> "$WORK/env"
        elif [ -f "$CARRY/debs/busybox-static.deb" ]; then
            dpkg -x "$CARRY/debs/busybox-static.deb" "$WORK/bbx" || return 1
            echo "GPUHOOK_DEVICE_BUSYBOX=$WORK/bbx/bin/busybox" >> "$WORK/env"
        else echo "no static busybox: install busybox-static or carry one"; return 1; fi
    fi
    if [ -z "${GPUHOOK_DEVICE_CUDATEST:-}" ] && ! command -v gcc >/dev/null; then
        [ -x "$CARRY/cudatest" ] || { echo "no gcc and no $CARRY/cudatest"; return 1; }
        echo "GPUHOOK_DEVICE_CUDATEST=$CARRY/cudatest" >> "$WORK/env"
    fi
    echo "tools ready"
}

# A driver root for the hook: / when the system's ld cache lists libnvidia-ml.so.1 and
# nvidia-smi is an ELF file in /usr/bin; else one assembled from copies of the driver's files.
driver_root() {
    local lib smi droot=$WORK/droot ldc=/sbin/ldconfig
    [ -x /sbin/ldconfig.real ] && ldc=/sbin/ldconfig.real
    lib=$(ldconfig -p | awk '/libnvidia-ml.so.1 .*x86-64/ {print $NF; exit}')
    if [ -n "$lib" ] && [ "$(head -c 4 /usr/bin/nvidia-smi 2>/dev/null)" = $'\x7fELF' ]; then
        echo "/"; return 0
    fi
    lib=${lib:-$(find /usr/local/nvidia /run/nvidia/driver /usr/lib /usr/lib64 -maxdepth 4 -name 'libnvidia-ml.so.1' 2>/dev/null | head -1)}
    [ -n "$lib" ] || { echo "no libnvidia-ml.so.1 anywhere" >&2; return 1; }
    rm -rf "$droot" && mkdir -p "$droot/usr/lib/x86_64-linux-gnu" "$droot/usr/bin" "$droot/etc"
    (cd "$(dirname "$(readlink -f "$lib")")" && cp -aL libcuda.so* libnvidia-ml.so* libnvidia-ptxjitcompiler.so* \
        libnvidia-nvvm.so* libnvidia-gpucomp.so* libnvidia-allocator.so* libnvidia-cfg.so* \
        "$droot/usr/lib/x86_64-linux-gnu/" 2>/dev/null)
    for tool in nvidia-smi nvidia-debugdump nvidia-persistenced; do
        smi=$(find /usr/local/nvidia/bin /run/nvidia/driver/usr/bin /usr/bin -maxdepth 1 -name $tool 2>/dev/null |
              while read -r f; do [ "$(head -c 4 "$f")" = $'\x7fELF' ] && echo "$f"; done | head -1)
        [ -n "$smi" ] && cp -L "$smi" "$droot/usr/bin/"
    done
    echo /usr/lib/x86_64-linux-gnu > "$droot/etc/ld.so.conf"
    $ldc -r "$droot" >&2 || return 1
    echo "$droot"
}

write_config() {
    local root ldc=/sbin/ldconfig reset='/nonexistent/gpuhook-device-tests-never-reset -i {uuid}' kill=false
    [ -x /sbin/ldconfig.real ] && ldc=/sbin/ldconfig.real
    if [ "${GPUHOOK_DEVICE_RESET:-}" = 1 ]; then reset='nvidia-smi --gpu-reset -i {uuid}'; kill=true; fi
    if [ "$MODE" = sim ]; then
        sed -e '/^log-file\|^state-dir/d' "$WORK/sim/config.toml"
    else
        root=$(driver_root) || return 1
        printf 'driver-root = "%s"\nldconfig = "%s"\n' "$root" "$ldc"
    fi
    printf 'state-dir = "%s"\nlog-file = "%s"\n[health]\nreset-command = "%s"\nkill-orphans = %s\n' \
        "$WORK/run" "$WORK/gpuhook.log" "$reset" "$kill"
}

rm -rf "$WORK/run" "$WORK/env" "$WORK/gpuhook.log" && touch "$WORK/env"
if [ "$MODE" = sim ]; then
    step simulate 60 $PY -m gpuhook simulate "$WORK/sim" --gpus 1 || exit 1
    export GPUHOOK_DEVICE_SIMULATED=$WORK/sim
fi
step facts 30 bash -c "$(declare -f facts); MODE=$MODE WORK=$WORK facts"
BEFORE=$(gpu_state 2>&1)
step tools 60 bash -c "$(declare -f tools); CARRY=$CARRY WORK=$WORK PY=$PY tools" || status=1
set -a; . "$WORK/env"; set +a
export MODE WORK
if step config 60 bash -c "$(declare -f driver_root write_config); write_config > $WORK/config.toml"; then
    export GPUHOOK_DEVICE_CONFIG=$WORK/config.toml
    export GPUHOOK_DEVICE_FIGURES=$OUT/figures.json GPUHOOK_DEVICE_ROUNDS=$ROUNDS
    left=$(( 270 - ($(date +%s) - START) ))
    (cd "$REPO" && step pytest $(( left > 30 ? left : 30 )) $PY -m pytest tests/device -v -rA -p no:cacheprovider \
        --junitxml "$OUT/device-tests.xml")
    rc=$?
    [ $rc -ne 0 ] && status=$rc
else
    status=1
fi
AFTER=$(gpu_state 2>&1)
if [ "$BEFORE" = "$AFTER" ] || [ "${GPUHOOK_DEVICE_RESET:-}" = 1 ]; then
    printf 'gpu-state\t0\t-\tunchanged: %s\n' "$AFTER" >> "$SUMMARY"
else
    printf 'gpu-state\t1\t-\tCHANGED: before %s after %s\n' "$BEFORE" "$AFTER" >> "$SUMMARY"
    status=1
fi
cp "$WORK/config.toml" "$WORK/gpuhook.log" "$LOGS/" 2>/dev/null
tar -C "$WORK" -czf "$OUT/logs.tar.gz" logs 2>/dev/null
echo; column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
[ -f "$OUT/figures.json" ] && cat "$OUT/figures.json"
exit $status
