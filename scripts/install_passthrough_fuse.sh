#!/usr/bin/env bash
# Install into a virtualenv a pyfuse3 that can use FUSE passthrough (Linux >= 6.9).
#
#   scripts/install_passthrough_fuse.sh VENV
#
# Passthrough lets the kernel serve reads of a fully cached file straight from
# the cache's data file, without a round trip through the daemon. It needs
# libfuse >= 3.17 (Debian 12 has 3.14) and two things pyfuse3 3.5 does not
# expose: FileInfo.backing_id and the session's /dev/fuse descriptor. So this:
#   1. builds libfuse 3.17.2 (Debian's upstream tarball, checked against its
#      SHA-256) into VENV/libfuse, the library only (no fusermount, no udev rules);
#   2. builds pyfuse3 3.5.0 from its PyPI sdist with
#      third_party/pyfuse3-3.5.0-passthrough.patch, linked to that libfuse (rpath).
# cachefs works with a stock pyfuse3 too; it then serves every read itself.
set -euo pipefail

venv=$(realpath "${1:?usage: $0 VENV}")
root=$(cd "$(dirname "$0")/.." && pwd)
libfuse_version=3.17.2
libfuse_sha256=3d932431ad94e86179e5265cddde1d67aa3bb2fb09a5bd35c641f86f2b5ed06f
libfuse_url=http://deb.debian.org/debian/pool/main/f/fuse3/fuse3_${libfuse_version}.orig.tar.gz
pyfuse3_version=3.5.0
prefix=$venv/libfuse
stamp=$venv/.passthrough-fuse-$libfuse_version-$pyfuse3_version

if [ -e "$stamp" ]; then
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "building libfuse $libfuse_version into $prefix (for FUSE passthrough)"
"$venv/bin/pip" install -q meson ninja
curl -fsS --retry 3 --max-time 120 -o "$work/libfuse.tar.gz" "$libfuse_url"
echo "$libfuse_sha256  $work/libfuse.tar.gz" | sha256sum -c --quiet
tar -xzf "$work/libfuse.tar.gz" -C "$work"
(
    cd "$work/fuse-$libfuse_version"
    PATH=$venv/bin:$PATH meson setup build --prefix="$prefix" --libdir=lib \
        -Dutils=false -Dexamples=false -Dtests=false -Dinitscriptdir= -Duseroot=false >"$work/meson.log" 2>&1 \
        || { cat "$work/meson.log"; exit 1; }
    PATH=$venv/bin:$PATH meson install -C build >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
)

echo "building pyfuse3 $pyfuse3_version with the passthrough patch"
"$venv/bin/pip" download -q --no-binary :all: --no-deps "pyfuse3==$pyfuse3_version" -d "$work"
tar -xzf "$work/pyfuse3-$pyfuse3_version.tar.gz" -C "$work"
patch -d "$work/pyfuse3-$pyfuse3_version" -p1 -s <"$root/third_party/pyfuse3-$pyfuse3_version-passthrough.patch"
"$venv/bin/pip" uninstall -q -y pyfuse3 >/dev/null 2>&1 || true  # a stock build, if any
PKG_CONFIG_PATH=$prefix/lib/pkgconfig LDFLAGS="-Wl,-rpath,$prefix/lib" \
    "$venv/bin/pip" install -q "$work/pyfuse3-$pyfuse3_version"
"$venv/bin/python" -c "import pyfuse3; pyfuse3.get_session_fd; pyfuse3.FileInfo(backing_id=1)"
touch "$stamp"
