# cachefs: `make demo` and `make test` do all the set-up on a fresh Debian machine (as root);
# `make install` installs for a role (docs/operations.md).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# What a spoke builds pyfuse3 with, and the demo runs: FUSE, a compiler, venv.
DEMO_PACKAGES := fuse3 libfuse3-dev pkg-config build-essential python3-venv python3-dev patch
# The tests' tools besides: the passthrough build (patch), the bench's link probe (curl),
# the regional cache tier (nginx), promtool (prometheus), the walkthrough's TLS files and loopback (openssl, iproute2),
# the NFS export (NFS-Ganesha with its VFS backend, rpcbind for NFSv3, libnfs's user-space client).
TEST_PACKAGES := $(DEMO_PACKAGES) curl nginx prometheus openssl iproute2 nfs-ganesha nfs-ganesha-vfs rpcbind libnfs-utils
STAMP      := $(VENV)/.installed
TEST_STAMP := $(VENV)/.test-installed

# PASSTHROUGH=no: the stock pyfuse3 only. By default `make setup` and `make install` also
# try the pyfuse3 that can use FUSE passthrough (scripts/install_passthrough_fuse.sh, about
# two minutes) and keep the stock one, with a warning, when that build fails.
PASSTHROUGH ?= yes
# make install: ROLE hub (no FUSE, no compiler), spoke or all.
PREFIX  ?= /opt/cachefs
BINDIR  ?= /usr/local/bin
SBINDIR ?= /sbin
ROLE    ?= all
# SYSTEM_FILES=no: only the virtualenv and the commands' symlinks (no units, users, /etc/cachefs).
SYSTEM_FILES ?= yes
INSTALL_PACKAGES_hub   := python3-venv
INSTALL_PACKAGES_spoke := $(DEMO_PACKAGES)
INSTALL_PACKAGES_all   := $(DEMO_PACKAGES)

.PHONY: all setup test-setup demo test bench lint install clean

all: setup

# apt packages: only installed when missing (needs root, as on CI).
define apt_install
	@missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
endef

setup: $(STAMP)

test-setup: $(TEST_STAMP)

# The demo's venv: the hub and the spoke, pyfuse3 with FUSE passthrough (libfuse 3.17 built
# into the venv if the system's is older), or the stock pyfuse3 if that build fails.
$(STAMP): pyproject.toml
	$(call apt_install,$(DEMO_PACKAGES))
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[hub,spoke]'
ifeq ($(PASSTHROUGH),yes)
	@echo "building the pyfuse3 for FUSE passthrough (PASSTHROUGH=no skips it)"
	@scripts/install_passthrough_fuse.sh $(VENV) >$(VENV)/passthrough-build.log 2>&1 \
		|| { echo "warning: cannot build the pyfuse3 for FUSE passthrough (see $(VENV)/passthrough-build.log); keeping the stock pyfuse3, with which the daemon serves every read" >&2; \
		     $(BIN)/pip install -q -e '.[hub,spoke]'; }
endif
	touch $(STAMP)

# The tests' venv adds pyfuse3 with FUSE passthrough (libfuse 3.17 built into the venv,
# see the script) for tests/test_passthrough.py, and a wheelhouse from which the install
# tests build venvs without a network.
$(TEST_STAMP): $(STAMP) pyproject.toml scripts/install_passthrough_fuse.sh third_party/pyfuse3-3.5.0-passthrough.patch
	$(call apt_install,$(TEST_PACKAGES))
	scripts/install_passthrough_fuse.sh $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip wheel -q -w $(VENV)/wheels '.[hub,spoke]' 'setuptools>=77'
	rm -f $(VENV)/wheels/cachefs-*.whl
	touch $(TEST_STAMP)

demo: setup
	$(BIN)/python scripts/demo.py

# Tests side by side in TEST_WORKERS processes (pytest-xdist): most of a test's time is
# spent waiting (mounts, emulated round trips, timeouts), so more workers than cores pay (docs/testing.md).
TEST_WORKERS ?= 4

test: test-setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# The benchmark, then torch's own DataLoader through cachefs over the same emulated WAN (a few minutes).
bench: test-setup
	$(BIN)/pip install -q -e '.[bench]' && $(BIN)/python -m bench $(BENCH_ARGS)
	$(BIN)/python -m bench.torch_loader $(TORCH_BENCH_ARGS)

# Style (ruff, ASYNC rules included) and types (mypy, strict for the hub and the spoke's packages).
lint: test-setup
	$(BIN)/python -m ruff check cachefs hubserver tests scripts examples bench
	$(BIN)/python -m mypy hubserver cachefs bench

install:
	$(call apt_install,$(INSTALL_PACKAGES_$(ROLE)))
	scripts/install.sh --role $(ROLE) --prefix $(PREFIX) --bin-dir $(BINDIR) --sbin-dir $(SBINDIR) \
		$(if $(filter no,$(PASSTHROUGH)),--no-passthrough-build) $(if $(filter no,$(SYSTEM_FILES)),--no-system-files)

clean:
	rm -rf $(VENV) build *.egg-info
