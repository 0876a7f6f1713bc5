#!/bin/sh
# Cairn demo: greet, show where the task runs, and leave a small output file.
echo "hello from task ${CAIRN_TASK_ID:-?} (attempt ${CAIRN_ATTEMPT_NUMBER:-?}): $*"
# An attempt runs as a uid of the worker's range, which has no name on most hosts.
user=$(id -un 2>/dev/null) || user="uid $(id -u)"
echo "running as $user in $(pwd)"
if [ -n "${CAIRN_OUTPUT_PATH:-}" ]; then
    echo "greeted $*" > "$CAIRN_OUTPUT_PATH" 2>/dev/null || true
fi
