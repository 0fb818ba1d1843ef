# streamkeep: `make serve` runs the server, `make test` runs every test. Both install what they
# need first (a .venv with the Python packages, conformance/node_modules from the npm lockfile).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VENV_STAMP := $(VENV)/.installed
NPM_STAMP := conformance/node_modules/.installed
ARGS ?=

.PHONY: serve serve-cluster test unit lint conformance conformance-h1 conformance-h2 conformance-disk conformance-quart conformance-auth conformance-cluster \
	client-conformance bench bench-quick bench-load bench-auth bench-compaction bench-disk bench-streams create-floor bench-recovery bench-cold bench-spark bench-cluster bench-client bench-ha bench-sync sessions-demo profile profile-cluster crash-test soak system-tools browser-tools h2load venv clean \
	torture docs

venv: $(VENV_STAMP)

$(VENV_STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (3.11+) on PATH"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

$(NPM_STAMP): conformance/package.json conformance/package-lock.json
	@command -v npm >/dev/null || { echo "need Node 20+ with npm on PATH for the conformance suite"; exit 1; }
	cd conformance && npm ci --no-audit --no-fund
	@touch $@

## Run the server on http://127.0.0.1:4437, streams kept durably in ./data. Extra flags: make serve ARGS="--port 8080"
serve: $(VENV_STAMP)
	$(VENV)/bin/streamkeep serve $(ARGS)

## Two single-writer processes behind HAProxy on port 4437 (streams placed by a hash of their
## names; data under data/cluster; forks, subscriptions and __registry__ work across them).
serve-cluster: $(VENV_STAMP) system-tools
	$(VENV)/bin/streamkeep cluster run --processes 2 --port 4437 --data-dir data/cluster $(ARGS)

## Every test: lint, our own tests, the official conformance suite over HTTP/1.1 and HTTPS+h2,
## on memory and on disk storage, and through the front door of a 2-process cluster.
test: lint unit conformance

# ruff (the ASYNC rules among them), mypy (strict where pyproject.toml says) and the package map's
# import contracts: a new cycle or an import climbing the layers fails here.
lint: $(VENV_STAMP) docs
	$(VENV)/bin/ruff check streamkeep tests ops
	$(VENV)/bin/ruff format --check streamkeep tests ops
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The docs site (docs/, mkdocs.yml) into site/: --strict fails on a link to a page or heading that is
# not there and on a page the nav leaves out. check_links judges anchors as GitHub makes them, where
# the README (outside docs/, so mkdocs never sees it) and the pages are read too.
docs: $(VENV_STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet
	$(PY) -m ops.check_links README.md docs/*.md

# The unit tests need Node packages too: the State Protocol's reference materializer
# (@durable-streams/state, conformance/materialize.mjs) judges compaction.
unit: $(VENV_STAMP) $(NPM_STAMP) system-tools browser-tools
	$(PY) -m pytest -q -n 2 --dist loadfile

# The fault tests mount a small tmpfs and an ext4 loop image (as root, as CI runs): mkfs.ext4
# comes from Debian's e2fsprogs. The cluster tests put Debian's haproxy in front of two processes, and
# coordinate replication through Debian's etcd (etcd-server, 3.4); the replication tests cut a machine
# off with iptables. The Postgres bridge's tests (streamkeep sync) start Debian's Postgres with initdb.
system-tools:
	@PATH="$$PATH:/usr/sbin:/sbin" command -v mkfs.ext4 >/dev/null || { apt-get update -qq && apt-get install -y -qq e2fsprogs; }
	@PATH="$$PATH:/usr/sbin:/sbin" command -v haproxy >/dev/null || { apt-get update -qq && apt-get install -y -qq haproxy; }
	@command -v etcd >/dev/null || { apt-get update -qq && apt-get install -y -qq etcd-server; }
	@PATH="$$PATH:/usr/sbin:/sbin" command -v iptables >/dev/null || { apt-get update -qq && apt-get install -y -qq iptables; }
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq postgresql; }

# The stream browser's tests (tests/test_ui_browser.py) drive the page in headless Chromium through
# Selenium: Debian's chromium and the chromedriver built for it.
browser-tools:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver; }

conformance: conformance-h1 conformance-h2 conformance-disk conformance-quart conformance-auth conformance-cluster

# Through HAProxy to a replicated cluster: two members, each on two processes (every commit on both
# before it is acknowledged, etcd deciding who owns). Forks and subscriptions cross members, and every
# member's follower was in sync and waited for (the runner checks all three). The unreplicated cluster
# (--replicas 1) is covered by tests/test_cluster*.py.
conformance-cluster: $(VENV_STAMP) $(NPM_STAMP) system-tools
	$(PY) -m ops.run_conformance --cluster 2 --replicas 2 --storage disk
	$(PY) -m ops.run_conformance --cluster 2 --replicas 2 --storage disk --tls-h2

conformance-h1: $(VENV_STAMP) $(NPM_STAMP)
	$(PY) -m ops.run_conformance

conformance-h2: $(VENV_STAMP) $(NPM_STAMP)
	$(PY) -m ops.run_conformance --tls-h2

conformance-disk: $(VENV_STAMP) $(NPM_STAMP)
	$(PY) -m ops.run_conformance --storage disk
	$(PY) -m ops.run_conformance --storage disk --tls-h2

# With auth on: the suite sends an admin token with every request (conformance/conformance.test.mjs).
conformance-auth: $(VENV_STAMP) $(NPM_STAMP)
	$(PY) -m ops.run_conformance --auth
	$(PY) -m ops.run_conformance --auth --storage disk --tls-h2

conformance-quart: $(VENV_STAMP) $(NPM_STAMP)
	$(PY) -m ops.run_conformance --edge quart
	$(PY) -m ops.run_conformance --edge quart --storage disk --tls-h2

## Upstream's client conformance suite against streamkeep.client (not part of `make test`: it runs
## from a checkout of the durable-streams repository, pinned to one commit in ops/client_conformance).
## Make one from the project's snapshot (these two packages; the whole tree lacks a blob):
##   mkdir -p /tmp/ds-upstream && git -C /work/.mirror/durable-streams+durable-streams/repo archive \
##     82f9963ae0b489566352393be9b4796c788c99c2 packages/client-conformance-tests packages/client-py | tar -x -C /tmp/ds-upstream
## make client-conformance UPSTREAM=/tmp/ds-upstream [ARGS="--server streamkeep" | ARGS="--adapter ts" | ARGS="-- --suite producer"]
CLIENT_NPM_STAMP := ops/client_conformance/node_modules/.installed

$(CLIENT_NPM_STAMP): ops/client_conformance/package.json ops/client_conformance/package-lock.json
	@command -v npm >/dev/null || { echo "need Node 20.11+ with npm on PATH for the client conformance suite"; exit 1; }
	cd ops/client_conformance && npm ci --no-audit --no-fund
	@touch $@

client-conformance: $(VENV_STAMP) $(CLIENT_NPM_STAMP)
	@test -n "$(UPSTREAM)" || { echo "usage: make client-conformance UPSTREAM=DIR (a checkout of durable-streams/durable-streams; see the Makefile)"; exit 2; }
	$(PY) -m ops.client_conformance --upstream $(UPSTREAM) $(ARGS)

## Benchmarks (not part of `make test`; they measure, they do not assert). `make bench` runs the load
## tests beside the Node reference server and rakaia-streams (the Python peer) plus recovery, cold-tier
## and Spark benchmarks (< 10 min); `make bench-quick` is the load tests' short form for development (< 2 min).
BENCH_STAMP := ops/bench/node_modules/.installed

# `npm install`, not `npm ci`: the lockfile lists only the platform packages of msgpackr-extract the
# registry here serves, and npm 11's `ci` refuses such a lockfile as out of sync; `install` follows
# the lockfile for everything it lists and leaves it unchanged.
$(BENCH_STAMP): ops/bench/package.json ops/bench/package-lock.json
	cd ops/bench && npm install --no-audit --no-fund
	@touch $@

# rakaia-streams, the Python peer the load tests run beside streamkeep and Node (on uvicorn, in memory
# and on its fsync'd JSONL store): pinned in ops/bench/rakaia-requirements.txt, installed in a virtualenv
# of its own so its dependencies never meet streamkeep's.
RAKAIA_VENV := ops/bench/.venv-rakaia
RAKAIA_STAMP := $(RAKAIA_VENV)/.installed

$(RAKAIA_STAMP): ops/bench/rakaia-requirements.txt
	$(PYTHON) -m venv $(RAKAIA_VENV)
	$(RAKAIA_VENV)/bin/python -m pip install --quiet -r ops/bench/rakaia-requirements.txt
	@touch $@

# The PyPI Durable Streams client (0.1.0, the last release), beside ours in `make bench-client`, in a
# virtualenv of its own.
PYPI_CLIENT_VENV := ops/bench/.venv-pypi-client
PYPI_CLIENT_STAMP := $(PYPI_CLIENT_VENV)/.installed

$(PYPI_CLIENT_STAMP):
	$(PYTHON) -m venv $(PYPI_CLIENT_VENV)
	$(PYPI_CLIENT_VENV)/bin/python -m pip install --quiet durable-streams==0.1.0
	@touch $@

## streamkeep.client's producer vs h2load, and its catch-up reader vs a plain GET loop, beside the PyPI
## client (~1 minute).
bench-client: $(VENV_STAMP) h2load $(PYPI_CLIENT_STAMP)
	$(PY) -m ops.bench_client --pypi-python $(PYPI_CLIENT_VENV)/bin/python

## The durable sessions stack of seed 000: Postgres, streamkeep and `streamkeep sync` with the two
## flows (table items -> stream pg-items, stream session-events -> table session_events); prints what
## to type. ARGS="--dir DIR" keeps everything in DIR.
sessions-demo: $(VENV_STAMP) system-tools
	$(PY) -m ops.sessions_demo $(ARGS)

## Postgres -> stream rows/s from one slot and commit-to-readable latency, stream -> Postgres
## messages/s in state mode, beside what Postgres alone commits with the same writers.
bench-sync: $(VENV_STAMP) system-tools
	$(PY) -m ops.bench_sync $(ARGS)

h2load:
	@command -v h2load >/dev/null || { apt-get update -qq && apt-get install -y -qq nghttp2-client; }

bench: bench-load bench-auth bench-compaction bench-recovery bench-cold bench-spark bench-cluster bench-client

## What surviving a lost machine would cost an append: fdatasync, a follower's round trip, S3 PUTs on
## moto (docs/scaling.md; ~10 s).
bench-ha: $(VENV_STAMP)
	$(PY) -m ops.bench_ha

## Appends through HAProxy to two processes beside one process direct, HTTP/1.1 and h2c (~1 min);
## then what replication costs (--replicas 2 vs 1, alternating), failover, time to redundancy per GiB
## and the failover of a member holding many streams (ops/bench_replication.py; ~20-40 min on 2 cores).
## Extra flags for the second: make bench-cluster REPLICATION_ARGS="--streams 100000 --fill-mib 4096"
bench-cluster: $(VENV_STAMP) system-tools h2load
	$(PY) -m ops.bench_cluster
	$(PY) -m ops.bench_replication $(REPLICATION_ARGS)

## Compaction of a 1 GiB State Protocol stream (100k keys): time, peak memory, other streams' latency.
bench-compaction: $(VENV_STAMP)
	$(PY) -m ops.bench_compaction

## What auth (HS256, ES256 via JWKS), metrics and the access log cost an append, in one run.
bench-auth: $(VENV_STAMP) h2load
	$(PY) -m ops.bench_auth

bench-quick: $(VENV_STAMP) $(BENCH_STAMP) $(RAKAIA_STAMP) h2load
	$(PY) -m ops.loadtest --quick

bench-load: $(VENV_STAMP) $(BENCH_STAMP) $(RAKAIA_STAMP) h2load
	$(PY) -m ops.loadtest

## Durable appends only, fdatasync vs syncfs group commit, beside the Node reference server.
bench-disk: $(VENV_STAMP) $(BENCH_STAMP) h2load
	$(PY) -m ops.bench_disk

## Many streams on one disk process (issue 26): creates/s with 64 connections, RSS per idle stream after
## hibernation, appends over all streams vs over 1,024 (100,000 streams: a few minutes on 2 cores).
## Extra flags: make bench-streams ARGS="--streams 20000 --json streams.json"
bench-streams: $(VENV_STAMP) h2load
	$(PY) -m ops.bench_streams $(ARGS)

## The file system's floor for creates (issue 26): the server's create steps alone, one thread, per
## sync method, beside one synced shared file; run it beside bench-streams (~1 min on a shared disk).
## Extra flags: make create-floor ARGS="--dir /var/lib/streamkeep --creates 12800"
create-floor: $(VENV_STAMP)
	$(PY) -m ops.create_floor $(ARGS)

## Where an append's microseconds go (issue 15): server CPU per append, split by component from py-spy
## samples, memory and disk, HTTP/1.1 and h2c; server and load pinned to their own cores (~1 min).
## py-spy comes with .venv (the dev extra). Extra flags: make profile ARGS="--seconds 3 --json profile.json"
profile: $(VENV_STAMP) h2load
	$(PY) -m ops.profile_append --markdown $(ARGS)

## The same question for the cluster's front door (issue 26): one member behind HAProxy at its share of
## an 8-member cluster's load, against the same rate sent straight to it; CPU per append of HAProxy and
## the member (user/sys), context switches, and where the member's extra µs go (py-spy; ~1.5 min).
## Needs haproxy (make system-tools). Extra flags: make profile-cluster ARGS="--rounds 3 --storage disk"
profile-cluster: $(VENV_STAMP) h2load
	$(PY) -m ops.profile_cluster --markdown $(ARGS)

bench-recovery: $(VENV_STAMP)
	$(PY) -m ops.bench_recovery

bench-cold: $(VENV_STAMP)
	$(PY) -m ops.bench_cold

bench-spark: $(VENV_STAMP)
	$(PY) -m ops.bench_spark

## A soak under stream churn: are the server's descriptors and memory flat? (not part of `make test`)
## make soak DURATION=30 (minutes) ARGS="--cold"
## A replicated cluster (every replica, etcd, HAProxy and the supervisor sampled, a verdict each):
## make soak DURATION=120 ARGS="--replicas 2 --writers 4 --readers 4"   (--processes N: members, default 2)
DURATION ?= 30
soak: $(VENV_STAMP)
	$(PY) -m ops.soak --minutes $(DURATION) $(ARGS)

## The kill -9 crash test on its own (it also runs inside `make unit`).
crash-test: $(VENV_STAMP)
	$(PY) -m ops.crash_test --kills 20

## Torture (issue 11): DURATION minutes (default 30) of seeded runs. A third in-process (the server on a
## simulated disk and bucket, power cuts included, across fsync modes), the rest black box (a real
## server process under kill -9, full disks and a stopped bucket, 2 minutes a run, on tmpfs, an ext4
## loop image and a plain directory). Needs root (mounts). Exit status 1 on any finding; each failing
## run prints the command that replays it.
## ARGS replaces the whole command line: e.g. the replicated cluster (issue 23; also needs etcd and
## iptables) for 30 minutes of one run: make torture ARGS="blackbox --cluster 3 --replicas 2 --minutes 30"
DURATION ?= 30
SEED ?= 1
torture: $(VENV_STAMP)
	$(PY) -m ops.torture $(if $(ARGS),$(ARGS),all --total-minutes $(DURATION) --seed $(SEED))

clean:
	rm -rf $(VENV) conformance/node_modules ops/client_conformance/node_modules ops/client_conformance/suite .pytest_cache .ruff_cache .mypy_cache .import_linter_cache
