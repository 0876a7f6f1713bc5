#!/bin/sh
# The worker container's entry point: its cgroups made writable, then `cairn "$@"`. Docker
# mounts the container's own cgroups read-only; with CAP_SYS_ADMIN (the compose file adds
# it, for the attempts' mount namespaces too) they are remounted writable, so that the
# agent gives each attempt cgroups of its own inside the container's. Where that is
# refused the agent still starts, and says at start-up which limits it cannot enforce.
set -u
for point in $(awk '$3 == "cgroup" || $3 == "cgroup2" { print $2 }' /proc/self/mounts); do
    mount -o remount,rw,bind "$point" 2>/dev/null \
        || echo "cairn-worker-entrypoint: $point stays read-only" >&2
done
exec cairn "$@"
