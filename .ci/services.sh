#!/usr/bin/env bash
# Start the servers the marked tests need (redis, postgres), on loopback only. Idempotent: a server
# that already answers is left running, a missing package is installed (CI runs as root on Debian
# bookworm), a missing role or database is created. Prints the URLs the tests read; exports nothing.
#
#   RAGKV_TEST_REDIS_URL     default redis://127.0.0.1:6379/15
#   RAGKV_TEST_POSTGRES_URL  default postgresql+psycopg://ragkv:ragkv@127.0.0.1:5432/ragkv_test
set -euo pipefail

REDIS_PORT=6379
PG_VERSION=15
PG_CLUSTER=main
PG_PORT=5432
PG_ROLE=ragkv
PG_PASSWORD=ragkv
PG_DB=ragkv_test

log() { echo "services.sh: $*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

wait_for() {  # wait_for SECONDS COMMAND...: retry COMMAND until it succeeds or time runs out
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then return 1; fi
    sleep 0.2
  done
}

install_missing() {
  local pkgs=()
  command -v redis-server >/dev/null || pkgs+=(redis-server)
  command -v tc >/dev/null || pkgs+=(iproute2)  # the rate-limited link of tests/planner/test_limited_link.py
  [ -x "/usr/lib/postgresql/${PG_VERSION}/bin/postgres" ] || pkgs+=("postgresql-${PG_VERSION}")
  command -v pg_ctlcluster >/dev/null || pkgs+=(postgresql-common)
  # the web page test of ragkv serve (tests/server/test_web_page.py) drives a real headless chromium
  command -v chromium >/dev/null || pkgs+=(chromium)
  command -v chromedriver >/dev/null || pkgs+=(chromium-driver)
  if [ "${#pkgs[@]}" -gt 0 ]; then
    log "installing ${pkgs[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
  fi
}

start_redis() {
  if ! redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping >/dev/null 2>&1; then
    log "starting redis-server on 127.0.0.1:${REDIS_PORT}"
    redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --protected-mode yes \
      --save '' --appendonly no --daemonize yes --logfile /tmp/ragkv-redis.log \
      --dir /tmp --pidfile /tmp/ragkv-redis.pid
    wait_for 20 redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping || { log "redis did not start"; exit 1; }
  fi
  # A redis started by the package's own init script persists by default; the tests want none.
  redis-cli -h 127.0.0.1 -p "$REDIS_PORT" config set save '' >/dev/null
  redis-cli -h 127.0.0.1 -p "$REDIS_PORT" config set appendonly no >/dev/null
}

pg_psql() {  # run psql as the postgres superuser over the local socket
  as_root runuser -u postgres -- psql -p "$PG_PORT" -v ON_ERROR_STOP=1 -tAq "$@"
}

start_postgres() {
  if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "${PG_VERSION} ${PG_CLUSTER}"; then
    log "creating cluster ${PG_VERSION}/${PG_CLUSTER}"
    as_root pg_createcluster "$PG_VERSION" "$PG_CLUSTER" --port "$PG_PORT" >/dev/null
  fi
  if ! as_root pg_ctlcluster "$PG_VERSION" "$PG_CLUSTER" status >/dev/null 2>&1; then
    log "starting postgresql ${PG_VERSION}/${PG_CLUSTER} on 127.0.0.1:${PG_PORT}"
    # listen_addresses is pinned here (not in the config file) so a reused cluster stays on loopback.
    as_root pg_ctlcluster "$PG_VERSION" "$PG_CLUSTER" start -- -o "-c listen_addresses=127.0.0.1"
  fi
  wait_for 30 pg_psql -c 'SELECT 1' || { log "postgresql did not start"; exit 1; }
  if [ "$(pg_psql -c "SELECT 1 FROM pg_roles WHERE rolname = '${PG_ROLE}'")" != "1" ]; then
    pg_psql -c "CREATE ROLE ${PG_ROLE} LOGIN PASSWORD '${PG_PASSWORD}'"
  fi
  if [ "$(pg_psql -c "SELECT 1 FROM pg_database WHERE datname = '${PG_DB}'")" != "1" ]; then
    pg_psql -c "CREATE DATABASE ${PG_DB} OWNER ${PG_ROLE}"
  fi
  # Password auth over TCP (Debian's pg_hba.conf uses scram-sha-256 for 127.0.0.1/32).
  wait_for 10 env PGPASSWORD="$PG_PASSWORD" psql -h 127.0.0.1 -p "$PG_PORT" -U "$PG_ROLE" -d "$PG_DB" -tAc 'SELECT 1' \
    || { log "cannot log in to postgresql as ${PG_ROLE} with a password"; exit 1; }
}

install_missing
start_redis
start_postgres

echo "RAGKV_TEST_REDIS_URL=redis://127.0.0.1:${REDIS_PORT}/15"
echo "RAGKV_TEST_POSTGRES_URL=postgresql+psycopg://${PG_ROLE}:${PG_PASSWORD}@127.0.0.1:${PG_PORT}/${PG_DB}"
