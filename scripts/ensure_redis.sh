#!/bin/sh
# Provides redis-server for the tests that start a real Redis (make test, .ci/run): nothing
# to do when it is on PATH; installed with apt-get when missing and we are root (a fresh
# container, CI); otherwise one line saying what to install, and a non-zero exit.
command -v redis-server >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "redis-server is missing: installing it with apt-get (the Redis tests need it)" >&2
    if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            redis-server) >/dev/null 2>&1 && command -v redis-server >/dev/null 2>&1; then
        exit 0
    fi
    echo "make test: apt-get could not install redis-server; install it (apt-get install redis-server) and rerun" >&2
    exit 1
fi
echo "make test: redis-server is missing: install it (sudo apt-get install redis-server, or brew install redis) and rerun" >&2
exit 1
