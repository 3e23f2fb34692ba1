#!/bin/sh
# Regenerates ld.so.cache here with the host's ldconfig (as root; gcc needed). Kept in the
# repository as made by Debian 12's ldconfig (glibc 2.36); see README.md.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/usr/lib/x86_64-linux-gnu" "$root/etc"
for lib in libnvidia-ml:1 libcuda:1 libnvidia-ptxjitcompiler:1 libGLX_nvidia:0; do
  name=${lib%%:*} major=${lib#*:}
  echo "int ${name#lib}_marker;" | sed 's/-/_/g' > "$root/x.c"
  gcc -shared -fPIC -Wl,-soname,"$name.so.$major" -o "$root/usr/lib/x86_64-linux-gnu/$name.so.550.54.15" "$root/x.c"
done
printf '/usr/lib/x86_64-linux-gnu\n' > "$root/etc/ld.so.conf"
ldconfig -r "$root"
cp "$root/etc/ld.so.cache" "$here/ld.so.cache"
