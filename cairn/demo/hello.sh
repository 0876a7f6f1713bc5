#!/bin/sh
# Cairn demo: greet, show where the task runs, and leave a small output file.
echo "hello from task ${CAIRN_TASK_ID:-?} (attempt ${CAIRN_ATTEMPT_NUMBER:-?}): $*"
echo "running as $(id -un) in $(pwd)"
if [ -n "${CAIRN_OUTPUT_PATH:-}" ]; then
    echo "greeted $*" > "$CAIRN_OUTPUT_PATH" 2>/dev/null || true
fi
