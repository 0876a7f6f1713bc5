#!/bin/sh
# PgBouncer (Debian's package) in transaction mode in front of $PGBOUNCER_SERVER_HOST:
# the request pools of core, cron and dag connect here (CAIRN_DATABASE_URL); their LISTEN,
# leader locks and migrations go straight to PostgreSQL (CAIRN_DATABASE_DIRECT_URL). The
# configuration is written at every start, from the environment, to a folder of this
# user's own; PgBouncer refuses to run as root. docs/architecture.md, "Behind a
# connection pooler", has why each setting is what it is.
set -eu
: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
user=${POSTGRES_USER:-postgres}
dir=$(mktemp -d)
umask 077
printf '"%s" "%s"\n' "$user" "$POSTGRES_PASSWORD" > "$dir/userlist.txt"
cat > "$dir/pgbouncer.ini" <<CONF
[databases]
* = host=${PGBOUNCER_SERVER_HOST:-postgres} port=${PGBOUNCER_SERVER_PORT:-5432}

[pgbouncer]
listen_addr = 0.0.0.0
listen_port = 6432
unix_socket_dir =
auth_type = scram-sha-256
auth_file = $dir/userlist.txt
pool_mode = transaction
max_client_conn = ${PGBOUNCER_MAX_CLIENT_CONN:-1000}
default_pool_size = ${PGBOUNCER_POOL_SIZE:-40}
max_db_connections = ${PGBOUNCER_MAX_DB_CONNECTIONS:-100}
server_idle_timeout = 60
CONF
exec /usr/sbin/pgbouncer "$dir/pgbouncer.ini"
