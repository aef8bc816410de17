# cachefs: `make demo` and `make test` do all the set-up on a fresh Debian machine (as root).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
APT_PACKAGES := fuse3 libfuse3-dev pkg-config curl patch nginx prometheus nfs-ganesha nfs-ganesha-vfs rpcbind libnfs-utils
STAMP  := $(VENV)/.installed

.PHONY: all setup system-packages demo test bench lint clean

all: setup

setup: $(STAMP)

# apt packages: only installed when missing (needs root, as on CI).
system-packages:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# pyfuse3 with FUSE passthrough (libfuse 3.17 built into the venv): see the script.
$(STAMP): pyproject.toml scripts/install_passthrough_fuse.sh third_party/pyfuse3-3.5.0-passthrough.patch | system-packages
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	scripts/install_passthrough_fuse.sh $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: system-packages setup
	$(BIN)/python scripts/demo.py

# Tests side by side in TEST_WORKERS processes (pytest-xdist): most of a test's time is
# spent waiting (mounts, emulated round trips, timeouts), so 4 on 2 cores: 277 s against 720 s.
TEST_WORKERS ?= 4

test: system-packages setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

bench: system-packages setup
	$(BIN)/pip install -q -e '.[bench]' && $(BIN)/python -m cachefs.bench $(BENCH_ARGS)

lint: setup
	$(BIN)/python -m ruff check cachefs hubserver tests scripts

clean:
	rm -rf $(VENV) build *.egg-info
