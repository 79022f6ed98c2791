#!/bin/sh
# tierwatch-entrypoint: the images' ENTRYPOINT. For each secret variable VAR below, a
# VAR_FILE naming a readable file sets VAR to that file's content (Docker/Kubernetes secrets,
# or the agent tokens the compose `bootstrap` service writes) and is then unset, so that
# `tierwatch-agent run` (which reads TIERWATCH_TOKEN_FILE itself too) does not see a token
# and its file both; then it runs the command.
#
#   TIERWATCH_TOKEN_FILE=/var/lib/tierwatch/tokens/node-1.token tierwatch-agent run ...
set -eu
for var in TIERWATCH_TOKEN TIERWATCH_SECRET_KEY; do
    eval "file=\${${var}_FILE:-}"
    if [ -n "$file" ]; then
        if [ ! -r "$file" ] || [ ! -s "$file" ]; then
            echo "tierwatch-entrypoint: ${var}_FILE=$file is missing, empty or unreadable" >&2
            exit 78  # EX_CONFIG
        fi
        value=$(cat "$file")
        export "$var=$value"
        unset "${var}_FILE"
    fi
done
if [ "$#" -eq 0 ]; then
    echo "tierwatch-entrypoint: no command given" >&2
    exit 64
fi
exec "$@"
