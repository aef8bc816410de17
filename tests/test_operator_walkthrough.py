"""docs/operations.md, run as an operator would: every block marked `walkthrough`, in
order, verbatim, as root on one machine that is hub and spoke at once.

The run happens in its own mount, network and pid namespaces, so that the documented
paths (/opt/cachefs, /etc/cachefs, /sbin/mount.fuse.cachefs, /etc/fstab, port 8470)
are the real ones without touching the machine's: /etc, /opt, /usr/local and /sbin are
overlays whose writes land in a temporary directory, /srv, /var/cache, /mnt and
/run/mount are fresh tmpfs, and the network is a loopback of its own where
hub.example.internal is 127.0.0.1. pip installs from the wheelhouse of `make
test-setup`, offline. systemd is not PID 1 here: `systemctl` is tests/unit_runner.py,
which starts the installed unit's command as its user with its settings and waits
for its READY=1. After the documented steps, the test checks what they promise:
the hub runs as `cachefs`, a member of the readers' group reads the dataset's bytes
through both mounts, and anyone else is refused.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from dataset import source_files
from install_helpers import REPO_ROOT, offline_env

OPERATIONS = REPO_ROOT / "docs" / "operations.md"
UNIT_RUNNER = Path(__file__).resolve().parent / "unit_runner.py"
WALKTHROUGH_TIMEOUT_S = 600


def walkthrough_blocks(markdown: str) -> list[str]:
    """The code blocks whose info string is `sh walkthrough`, in order."""
    return re.findall(r"^```sh walkthrough\n(.*?)^```$", markdown, re.MULTILINE | re.DOTALL)


def setup_script(work: Path, dataset: Path) -> str:
    """Namespaces' plumbing and the hub's dataset: what the machine has before the doc starts."""
    overlays = "\n".join(
        f"mkdir -p {work}/upper{d} {work}/work{d} && "
        f"mount -t overlay overlay -o lowerdir={d},upperdir={work}/upper{d},workdir={work}/work{d} {d}"
        for d in ("/etc", "/opt", "/usr/local", os.path.realpath("/sbin"))
    )
    return textwrap.dedent(
        """\
        set -euo pipefail
        ip link set lo up
        """
    ) + overlays + textwrap.dedent(
        f"""
        mkdir -p /run/mount
        for d in /srv /var/cache /mnt /run/mount; do mount -t tmpfs -o mode=0755 tmpfs $d; done
        echo '127.0.0.1 hub.example.internal' >> /etc/hosts
        mkdir -p /srv/cachefs
        cp -a {shlex.quote(str(dataset))} /srv/cachefs/dataset
        chown -R root:root /srv/cachefs/dataset
        find /srv/cachefs/dataset -type d -exec chmod 0750 {{}} +
        find /srv/cachefs/dataset -type f -exec chmod 0640 {{}} +
        systemctl() {{ {shlex.quote(sys.executable)} {UNIT_RUNNER} {work}/units "$@"; }}
        mkdir -p {work}/units
        cd {shlex.quote(str(REPO_ROOT))}
        """
    )


def checks_script(work: Path, files: list[str]) -> str:
    """What the documented steps promise, checked after them."""
    compare = "\n".join(
        f"runuser -u nobody -g training -- cat /mnt/data/{shlex.quote(f)} | cmp - /srv/cachefs/dataset/{shlex.quote(f)}"
        for f in files
    )
    first = shlex.quote(files[0])
    return textwrap.dedent(
        f"""
        echo '--- checks'
        test "$(ps -o user= -p "$(cat {work}/units/cachefs-hub.pid)")" = cachefs
        test "$(stat -c '%U %a' /etc/cachefs/hub.tokens /etc/cachefs/hub.key)" = "$(printf 'cachefs 600\\ncachefs 600')"
        test "$(findmnt -n -o SOURCE,FSTYPE /mnt/data)" = "https://hub.example.internal:8470 fuse.cachefs"
        test "$(readlink -f /usr/local/bin/cachefs)" = /opt/cachefs/bin/cachefs
        """
    ) + compare + textwrap.dedent(
        f"""
        if runuser -u nobody -- cat /mnt/data/{first} >/dev/null 2>&1; then
            echo "nobody outside the group training read /mnt/data/{first}" >&2; exit 1
        fi
        systemctl stop cachefs@mnt-data
        ! findmnt /mnt/data >/dev/null
        mount /mnt/data
        runuser -u nobody -g training -- cat /mnt/data/{first} | cmp - /srv/cachefs/dataset/{first}
        umount /mnt/data
        echo '--- walkthrough passed'
        """
    )


def test_operations_doc_has_a_walkthrough() -> None:
    blocks = walkthrough_blocks(OPERATIONS.read_text())
    text = "\n".join(blocks)
    for step in ("make install ROLE=hub", "make install ROLE=spoke", "systemctl enable --now cachefs-hub",
                 "mount /mnt/data", "systemctl enable --now cachefs@mnt-data"):
        assert step in text, step


@pytest.mark.skipif(os.geteuid() != 0, reason="namespaces, overlays and mounts need root")
@pytest.mark.timeout(WALKTHROUGH_TIMEOUT_S + 60)
def test_the_documented_steps_work(dataset: Path, tmp_path: Path) -> None:
    work = tmp_path / "walkthrough"
    work.mkdir()
    files = [str(path) for path in source_files(dataset) if re.fullmatch(r"[\w./-]+", str(path))][:5]
    blocks = walkthrough_blocks(OPERATIONS.read_text())
    script = setup_script(work, dataset)
    for index, block in enumerate(blocks):
        script += f"\necho '--- docs/operations.md walkthrough block {index + 1}'\nset -x\n{block}set +x\n"
    script += checks_script(work, files)
    (work / "walkthrough.sh").write_text(script)
    # Output to a file, not a pipe: the daemons the steps start hold their inherited descriptors.
    with open(work / "output.log", "w") as output:
        result = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--net", "--pid", "--mount-proc", "--kill-child",
             "bash", str(work / "walkthrough.sh")],
            stdout=output, stderr=subprocess.STDOUT, timeout=WALKTHROUGH_TIMEOUT_S, env=offline_env(),
            stdin=subprocess.DEVNULL, check=False,
        )
    logs = "".join(f"\n--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
                   for log in sorted((work / "units").glob("*.log")))
    text = (work / "output.log").read_text(errors="replace")
    assert result.returncode == 0, f"{text[-8000:]}{logs}"
    assert "--- walkthrough passed" in text
