#!/usr/bin/env bash
# The test command: sets up everything on a fresh machine, then runs pytest.
#   ./test.sh              the whole suite (real servers started by the tests)
#   ./test.sh -k fair      any pytest arguments pass through (to both phases, below)
#   ./test.sh faults ...   the fault harness (tests/faults/) instead of pytest:
#                          ./test.sh faults --quick | --long [--backends redis,zookeeper]
# It creates .venv, installs aiolock with its test extras, installs Debian's
# redis-server, zookeeper, postgresql, memcached and mariadb-server if they are missing, and
# runs pytest. The tests start their own servers on
# free loopback ports; nothing depends on a server started by hand.
set -euo pipefail
cd "$(dirname "$0")"

need_pkgs=()
command -v redis-server >/dev/null 2>&1 || need_pkgs+=(redis-server)
{ command -v java >/dev/null 2>&1 && [ -f /usr/share/java/zookeeper.jar ]; } || need_pkgs+=(zookeeper)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_pkgs+=(postgresql)
command -v memcached >/dev/null 2>&1 || need_pkgs+=(memcached)
[ -x /usr/sbin/mariadbd ] || need_pkgs+=(mariadb-server)
command -v tmux >/dev/null 2>&1 || need_pkgs+=(tmux)  # tests drive `aiolock top` in it
{ command -v etcd >/dev/null 2>&1 && command -v etcdctl >/dev/null 2>&1; } || need_pkgs+=(etcd-server etcd-client)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "installing: ${need_pkgs[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi
# Debian's packages start a redis on 6379, a postgres on 5432, a memcached on 11211 and a
# MariaDB on 3306 at install; the tests never use them.

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -vE "^\s*$|WARNING: Location" || true

if [ "${1:-}" = "faults" ]; then
  shift
  exec .venv/bin/python -m tests.faults "$@"
fi
# Two phases. Most tests wait on servers and timers (the suite keeps about one core
# busy), so first everything but the tests marked `serial` runs on
# $AIOLOCK_TEST_WORKERS pytest-xdist workers (default 2, one per core; each starts
# servers of its own); then the `serial` tests (timing bounds judged against an
# otherwise idle machine: the fault harness) run alone. AIOLOCK_TEST_WORKERS=1: one
# plain pytest run of everything.
workers=${AIOLOCK_TEST_WORKERS:-2}
if ! [[ "$workers" =~ ^[0-9]+$ ]] || [ "$workers" -lt 1 ]; then
  echo "AIOLOCK_TEST_WORKERS must be a whole number >= 1, got '$workers'" >&2
  exit 2
fi
if [ "$workers" -eq 1 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
set +e
AIOLOCK_TEST_PHASE=parallel .venv/bin/python -m pytest -n "$workers" "$@"
parallel=$?
AIOLOCK_TEST_PHASE=serial .venv/bin/python -m pytest "$@"
serial=$?
# 5 is pytest's "no tests collected": fine for one phase (-k picked tests of the other)
for code in "$parallel" "$serial"; do
  if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then exit "$code"; fi
done
if [ "$parallel" -eq 5 ] && [ "$serial" -eq 5 ]; then exit 5; fi
exit 0
