#!/usr/bin/env bash
# One pgbench sitting: each round runs every script once, in an order rotated per round, on
# emptied tables, one claim-and-complete pair per transaction. Prints "round script pairs/s".
#   DB='host=127.0.0.1 user=... dbname=...' C=16 T=6 R=8 S='probe store lean' benches/pgbench/run.sh
set -eu
here=$(cd "$(dirname "$0")" && pwd)
db=${DB:-${IDEMPOTENCY_PG_URL:?set DB or IDEMPOTENCY_PG_URL to a libpq connection string}}
C=${C:-16}; T=${T:-6}; R=${R:-8}; read -r -a scripts <<< "${S:-probe store lean lean_plain}"
PGOPTIONS="-c client_min_messages=warning" psql -q -X -v ON_ERROR_STOP=1 -f "$here/setup.sql" "$db"
n=${#scripts[@]}
for r in $(seq 1 "$R"); do
  for i in $(seq 0 $((n - 1))); do
    s=${scripts[$(((i + r) % n))]}
    psql -q -X -c "TRUNCATE pgbench_idem.probe, pgbench_idem.store, pgbench_idem.lean" "$db"
    tps=$(pgbench -n -M prepared -c "$C" -j 2 -T "$T" -f "$here/$s.pgb" "$db" 2>&1 |
      sed -n 's/^tps = \([0-9.]*\).*/\1/p')
    echo "$r $s ${tps:-failed}"
  done
done
