#!/bin/sh
# tierwatch-bootstrap-tokens DIR NODE...: create one agent token per node into DIR/NODE.token
# with `tierwatch-server token create --role agent --node NODE` (the compose `bootstrap`
# service; it needs the migrated database in TIERWATCH_DATABASE_URL). A token file that exists
# is kept, so running it again changes nothing; remove the file (or the volume) for a new one.
set -eu
if [ "$#" -lt 2 ]; then
    echo "usage: tierwatch-bootstrap-tokens DIR NODE..." >&2
    exit 64
fi
dir=$1
shift
mkdir -p "$dir"
umask 077
for node in "$@"; do
    file="$dir/$node.token"
    if [ -s "$file" ]; then
        echo "agent token for $node: kept $file" >&2
        continue
    fi
    tierwatch-server token create --role agent --node "$node" --label "compose bootstrap" \
        > "$file.tmp"
    mv "$file.tmp" "$file"
    echo "agent token for $node: created $file" >&2
done
