"""A day's files, as a data team writes it (docs/sdk.md): list the files that landed,
load each one in a task of its own, report the rows, and page someone if a load fails.

    cairn dag apply docs/examples/daily_files.py --dry-run  # the JSON definition, sent nowhere
    cairn dag apply docs/examples/daily_files.py            # store it (a new version if changed)
    python docs/examples/daily_files.py 2026-12-04          # store it, run it, wait for the end

Each step here is a line of shell so that it runs on ``cairn up`` as it is; in your
pipelines it is your ETL program (an artifact in your object store) with arguments.
"""

import hashlib
import sys
from pathlib import Path

from cairn.sdk import (
    MAP_ITEM,
    RUN_ID,
    Artifact,
    Client,
    MapSpec,
    Node,
    OutputSpec,
    Resources,
    RetryPolicy,
    TriggerRule,
    Workflow,
    param,
)

SH = Artifact(uri="file:///bin/sh", sha256=hashlib.sha256(Path("/bin/sh").read_bytes()).hexdigest())

# A task hands values on by writing a JSON object to the file $CAIRN_OUTPUTS names.
LIST = (
    'printf \'{"files": ["%s/a.csv", "%s/b.csv", "%s/c.csv"]}\' "$1" "$1" "$1" > "$CAIRN_OUTPUTS"'
)
LOAD = 'echo "loading $1"; printf \'{"rows": %d}\' "${#1}" > "$CAIRN_OUTPUTS"'
REPORT = 'echo "$1: rows per file $2"'
PAGE = 'echo "paging on-call: daily-files failed for $1" >&2'

with Workflow(
    "daily-files",
    description="Load the files that landed for a day, then report the rows.",
    params={"bucket": "s3://landing"},  # "day" has no default: every run gives it
    timeout_s=3600,
    max_active_nodes=8,
) as daily_files:
    extract = Node(
        "extract",
        artifact=SH,
        args=["-c", LIST, "extract", f"{param('bucket')}/{param('day')}"],
        outputs={
            "files": OutputSpec(),
            "manifest": OutputSpec(path=f"s3://lake/manifests/{RUN_ID}.json"),
        },
    )
    load = Node(
        "load",
        artifact=SH,
        args=["-c", LOAD, "load", MAP_ITEM, extract.outputs.manifest],
        map=MapSpec(over=extract.outputs.files, max_items=500),
        outputs=["rows"],
        resources=Resources(cpu=0.5, memory_mb=256),
        retry=RetryPolicy(max_attempts=3),
        timeout_s=1800,
    )
    report = Node(
        "report",
        artifact=SH,
        args=["-c", REPORT, "report", param("day"), load.outputs.rows],
        trigger_rule=TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS,
    )
    alert = Node(
        "alert",
        artifact=SH,
        args=["-c", PAGE, "alert", param("day")],
        trigger_rule=TriggerRule.ONE_FAILED,
    )
    extract >> load >> report
    [extract, load] >> alert


if __name__ == "__main__":
    cairn = Client()  # CAIRN_DAG_URL and CAIRN_TOKEN, found as the cairn command finds them
    cairn.apply(daily_files)
    run = cairn.start(daily_files, {"day": sys.argv[1]})
    print(f"run {run.id} started")
    result = run.wait()
    for name, state in result.states.items():
        print(f"  {name:10} {state}")
    print("rows:", result.outputs.get("load"))
    result.check()  # raises RunFailed (exit status 1) unless the run succeeded
