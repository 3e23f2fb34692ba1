#!/bin/sh
# Gather what tests/device/run-on-device.sh needs on a GPU machine without network, on a
# Debian-family machine that has apt and pip (tests/device/README.md):
#
#   tests/device/prepare-carry.sh [DIR]      # default tests/device/carry (ignored by git)
#
# DIR/debs: runc, libseccomp2, busybox-static (.deb, unpacked there with dpkg -x);
# DIR/wheels: nvidia-ml-py and pytest with their dependencies (pure Python);
# DIR/cudatest: tests/device/cudatest.c built for a machine without gcc.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${1:-$HERE/carry}
mkdir -p "$DIR/debs" "$DIR/wheels"
cd "$DIR/debs"
for pkg in runc libseccomp2 busybox-static; do
    apt-get download "$pkg"
    mv "$pkg"_*.deb "$pkg.deb"
done
python3 -m pip download --quiet --only-binary=:all: --dest "$DIR/wheels" nvidia-ml-py pytest
gcc -O2 -o "$DIR/cudatest" "$HERE/cudatest.c" -ldl
du -sh "$DIR"
