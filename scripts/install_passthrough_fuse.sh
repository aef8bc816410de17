#!/usr/bin/env bash
# Install into a virtualenv a pyfuse3 that can use FUSE passthrough (Linux >= 6.9).
#
#   scripts/install_passthrough_fuse.sh VENV
#
# Passthrough lets the kernel serve reads of a fully cached file straight from
# the cache's data file, without a round trip through the daemon. It needs
# libfuse >= 3.17 and two things pyfuse3 3.5 does not expose:
# FileInfo.backing_id and the session's /dev/fuse descriptor. So this:
#   1. uses the system's libfuse if it is >= 3.17 (pkg-config fuse3, from
#      libfuse3-dev). Otherwise it builds libfuse into VENV/libfuse, the library
#      only (no fusermount, no udev rules), from the fuse3 source package of this
#      machine's own apt archives: `apt-get source`, whose signed indexes vouch
#      for the bytes. Debian 12's suites have 3.14, so the deb-src entries made
#      from the machine's deb entries also name the next release's suite of the
#      same archive (FUSE_SOURCE_SUITE, default trixie). They live in a private
#      apt state: the machine's sources and package lists are left as they are.
#   2. builds pyfuse3 3.5.0 from its PyPI sdist with
#      third_party/pyfuse3-3.5.0-passthrough.patch, linked to that libfuse.
#      The patch also makes pyfuse3's main loop read /dev/fuse until it has
#      no more requests before it waits in epoll, and releases the GIL while
#      a read's reply is copied to the kernel (docs/performance.md).
# cachefs works with a stock pyfuse3 too; it then serves every read itself.
set -euo pipefail

venv=$(realpath "${1:?usage: $0 VENV}")
root=$(cd "$(dirname "$0")/.." && pwd)
min_libfuse=3.17
source_suite=${FUSE_SOURCE_SUITE:-trixie}
pyfuse3_version=3.5.0
prefix=$venv/libfuse
patch_file=$root/third_party/pyfuse3-$pyfuse3_version-passthrough.patch
# Named after the patch's hash, so that a changed patch rebuilds pyfuse3 in an existing venv.
stamp=$venv/.passthrough-pyfuse3-$pyfuse3_version-$(sha256sum "$patch_file" | cut -c1-16)

if [ -e "$stamp" ]; then
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 0755 "$work"  # apt downloads as its unprivileged user _apt

# The fuse3 source package >= $min_libfuse from this machine's apt archives, unpacked in $work.
fetch_libfuse_source() {
    local apt=$work/apt codename uri suite component version
    mkdir -p "$apt/sources" "$apt/lists/partial" "$apt/cache/archives/partial" "$work/download"
    codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(COMPONENT)' 'Created-By: Packages' | sort -u |
        while read -r uri suite component; do
            echo "deb-src $uri $suite $component"
            if [ -n "$codename" ] && [ "$suite" = "$codename" ]; then
                echo "deb-src $uri $source_suite $component"
            fi
        done >"$apt/sources/cachefs-deb-src.list"
    if [ ! -s "$apt/sources/cachefs-deb-src.list" ]; then
        echo "$0: this machine has no apt archives to take the libfuse source from" >&2
        exit 1
    fi
    local options=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$apt/sources"
                   -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o "Debug::NoLocking=1")
    apt-get "${options[@]}" -qq update
    version=$(apt-cache "${options[@]}" showsrc fuse3 | sed -n 's/^Version: //p' | sort -V | tail -n 1)
    if [ -z "$version" ] || dpkg --compare-versions "$version" lt "$min_libfuse"; then
        echo "$0: no fuse3 source >= $min_libfuse in this machine's apt archives (newest: ${version:-none}," \
             "suites: $(cut -d' ' -f3 "$apt/sources/cachefs-deb-src.list" | sort -u | tr '\n' ' ')); set" \
             "FUSE_SOURCE_SUITE to a suite of your archive that has it" >&2
        exit 1
    fi
    echo "fetching the fuse3 $version source with apt-get source"
    if id _apt >/dev/null 2>&1; then
        chown _apt "$work/download"
    fi
    (cd "$work/download" && apt-get "${options[@]}" -qq source --download-only "fuse3=$version")
    tar -xf "$(find "$work/download" -name 'fuse3_*.orig.tar.*' ! -name '*.asc' | head -n 1)" -C "$work"
}

build_libfuse() {
    local source
    fetch_libfuse_source
    source=$(find "$work" -maxdepth 1 -type d -name 'fuse-3.*' | head -n 1)
    echo "building libfuse from $source into $prefix"
    "$venv/bin/pip" install -q meson ninja
    (
        cd "$source"
        PATH=$venv/bin:$PATH meson setup build --prefix="$prefix" --libdir=lib \
            -Dutils=false -Dexamples=false -Dtests=false -Dinitscriptdir= -Duseroot=false >"$work/meson.log" 2>&1 \
            || { cat "$work/meson.log"; exit 1; }
        PATH=$venv/bin:$PATH meson install -C build >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
    )
}

if pkg-config --atleast-version="$min_libfuse" fuse3 2>/dev/null; then
    echo "using the system's libfuse $(pkg-config --modversion fuse3) (for FUSE passthrough)"
    build_env=()
else
    # A libfuse this script built into the venv before (only pyfuse3's patch changed) is kept.
    if ! PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --atleast-version="$min_libfuse" fuse3 2>/dev/null; then
        build_libfuse
    fi
    build_env=(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" LDFLAGS="-Wl,-rpath,$prefix/lib")
fi

echo "building pyfuse3 $pyfuse3_version with the passthrough patch"
"$venv/bin/pip" download -q --no-binary :all: --no-deps "pyfuse3==$pyfuse3_version" -d "$work"
tar -xzf "$work/pyfuse3-$pyfuse3_version.tar.gz" -C "$work"
patch -d "$work/pyfuse3-$pyfuse3_version" -p1 -s <"$patch_file"
"$venv/bin/pip" uninstall -q -y pyfuse3 >/dev/null 2>&1 || true  # a stock build, if any
env "${build_env[@]}" "$venv/bin/pip" install -q "$work/pyfuse3-$pyfuse3_version"
"$venv/bin/python" -c "import pyfuse3; pyfuse3.get_session_fd; pyfuse3.FileInfo(backing_id=1)"
rm -f "$venv"/.passthrough-pyfuse3-*  # the stamps of earlier patches
touch "$stamp"
