#!/bin/sh
# Cairn demo: work for a while ($1 seconds, default 3), reporting progress.
n=${1:-3}
i=0
while [ "$i" -lt "$n" ]; do
    i=$((i + 1))
    echo "step $i of $n"
    sleep 1
done
echo "done"
