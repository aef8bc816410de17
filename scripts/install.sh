#!/usr/bin/env bash
# Install cachefs for one role into a virtualenv, with its commands on PATH and
# its system files in place (what `make install` runs; docs/operations.md).
#
#   scripts/install.sh [--role hub|spoke|all] [--prefix DIR] [--bin-dir DIR]
#                      [--sbin-dir DIR] [--no-system-files] [--passthrough | --no-passthrough-build]
#
#   --role             hub: cachefs-hub, no FUSE and no compiler; spoke: cachefs,
#                      with pyfuse3 built against the system's libfuse3; all: both
#                      (default)
#   --prefix DIR       the virtualenv (default /opt/cachefs): DIR/bin/cachefs, ...
#   --bin-dir DIR      symlinks to the commands (default /usr/local/bin)
#   --sbin-dir DIR     mount.fuse.cachefs and mount.cachefs, the helpers mount(8)
#                      runs for `-t fuse.cachefs` and fstab (default /sbin)
#   --no-system-files  only the virtualenv and the symlinks (container images):
#                      no units, sysusers.d, tmpfiles.d, mount helpers, /etc/cachefs
#   --passthrough      a spoke's pyfuse3 must be the build that can use FUSE
#                      passthrough (scripts/install_passthrough_fuse.sh): fail if
#                      it cannot be built. By default a spoke tries that build and,
#                      if it fails, installs the stock pyfuse3 with a warning (the
#                      daemon then serves every read itself)
#   --no-passthrough-build
#                      the stock pyfuse3 only (no libfuse 3.17 build, no patch)
#
# System files: the systemd units (with DIR of --prefix in their commands) in
# /etc/systemd/system, the cachefs user (sysusers.d) and the owner and mode of
# the hub's secrets (tmpfiles.d), example settings /etc/cachefs/hub.env and
# /etc/cachefs/mnt-data.env (never over an existing file). Running it again
# upgrades cachefs in place.
set -euo pipefail

role=all
prefix=/opt/cachefs
bin_dir=/usr/local/bin
sbin_dir=/sbin
system_files=yes
passthrough=default
usage="usage: $0 [--role hub|spoke|all] [--prefix DIR] [--bin-dir DIR] [--sbin-dir DIR] [--no-system-files] [--passthrough | --no-passthrough-build]"
while [ $# -gt 0 ]; do
    case $1 in
        --role) role=${2:?$usage}; shift 2 ;;
        --prefix) prefix=${2:?$usage}; shift 2 ;;
        --bin-dir) bin_dir=${2:?$usage}; shift 2 ;;
        --sbin-dir) sbin_dir=${2:?$usage}; shift 2 ;;
        --no-system-files) system_files=no; shift ;;
        --passthrough) passthrough=yes; shift ;;
        --no-passthrough-build) passthrough=no; shift ;;
        -h|--help) echo "$usage"; exit 0 ;;
        *) echo "$0: unknown argument '$1'; $usage" >&2; exit 2 ;;
    esac
done
case $role in
    hub) extras=hub; commands="cachefs-hub" ;;
    spoke) extras=spoke; commands="cachefs" ;;
    all) extras=hub,spoke; commands="cachefs cachefs-hub" ;;
    *) echo "$0: --role is hub, spoke or all, not '$role'" >&2; exit 2 ;;
esac
case $prefix in
    /*) ;;
    *) echo "$0: --prefix must be an absolute path, not '$prefix'" >&2; exit 2 ;;
esac
if [ "$passthrough" = yes ] && [ "$role" = hub ]; then
    echo "$0: --passthrough is for a spoke (--role spoke or all)" >&2
    exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
systemd=$root/deploy/systemd

if [ ! -x "$prefix/bin/python" ]; then
    echo "creating the virtualenv $prefix"
    # The system's interpreter, not the first python3 on root's PATH (a pyenv or
    # conda under /root would leave the cachefs user unable to run the hub).
    "${PYTHON:-/usr/bin/python3}" -m venv "$prefix"
fi
if [ "$passthrough" = yes ]; then
    "$root/scripts/install_passthrough_fuse.sh" "$prefix"
elif [ "$passthrough" = default ] && [ "$role" != hub ]; then
    echo "building the pyfuse3 for FUSE passthrough (--no-passthrough-build skips it)"
    if ! "$root/scripts/install_passthrough_fuse.sh" "$prefix" >"$prefix/passthrough-build.log" 2>&1; then
        echo "warning: cannot build the pyfuse3 for FUSE passthrough (see $prefix/passthrough-build.log); installing the stock pyfuse3, with which the daemon serves every read" >&2
    fi
fi
# Built from a copy, so that the source tree gets no build/ or egg-info.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"
cp -r "$root/pyproject.toml" "$root/README.md" "$root/LICENSE" "$root/cachefs" "$root/hubserver" "$work/src/"
echo "installing cachefs[$extras] into $prefix"
"$prefix/bin/pip" install -q "$work/src[$extras]"

mkdir -p "$bin_dir"
for command in $commands; do
    ln -sfn "$prefix/bin/$command" "$bin_dir/$command"
done
echo "commands: $(for command in $commands; do printf '%s ' "$bin_dir/$command"; done)"
[ "$system_files" = yes ] || exit 0

# The units and the mount helper name the install prefix.
install_with_prefix() {  # SOURCE TARGET MODE
    sed "s|/opt/cachefs/|$prefix/|g" "$1" >"$work/file"
    install -D -m "$3" "$work/file" "$2"
}
if [ "$role" != spoke ]; then
    install_with_prefix "$systemd/cachefs-hub.service" /etc/systemd/system/cachefs-hub.service 0644
fi
if [ "$role" != hub ]; then
    install_with_prefix "$systemd/cachefs@.service" /etc/systemd/system/cachefs@.service 0644
    install_with_prefix "$systemd/cachefs-nfs@.service" /etc/systemd/system/cachefs-nfs@.service 0644
    install_with_prefix "$root/deploy/mount.cachefs" "$sbin_dir/mount.fuse.cachefs" 0755
    ln -sfn mount.fuse.cachefs "$sbin_dir/mount.cachefs"
fi
install -D -m 0644 "$systemd/cachefs-sysusers.conf" /etc/sysusers.d/cachefs.conf
install -D -m 0644 "$systemd/cachefs-tmpfiles.conf" /etc/tmpfiles.d/cachefs.conf
systemd-sysusers /etc/sysusers.d/cachefs.conf
systemd-tmpfiles --create /etc/tmpfiles.d/cachefs.conf
case $role in hub) examples=hub.env ;; spoke) examples=mnt-data.env ;; *) examples="hub.env mnt-data.env" ;; esac
for example in $examples; do
    if [ ! -e "/etc/cachefs/$example" ]; then
        install -m 0644 "$systemd/$example" "/etc/cachefs/$example"
    fi
done
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi
echo "system files: /etc/systemd/system, /etc/sysusers.d/cachefs.conf, /etc/tmpfiles.d/cachefs.conf, /etc/cachefs$(
    [ "$role" = hub ] || printf ', %s' "$sbin_dir/mount.fuse.cachefs")"
