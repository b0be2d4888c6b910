#!/usr/bin/env bash
# Fails (exit 1, printing file:line:text) when a tracked file holds an internal work counter (the
# word for a working period followed by its number, or a range of them) or words about how the work
# was organised (the sitting it was measured in, a machine that was or was not lent): the
# repository describes the code and what was measured. Name a measurement by its date, machine
# and commit instead. This script and its test
# (tests/test_words_check.py) hold the patterns and are not searched. .ci/run calls it before
# `make test`; it runs from anywhere inside the repository.
set -uo pipefail
cd "$(git rev-parse --show-toplevel)" || exit 2

pattern='[Ss]essions? [0-9]+|[Ss]essions [0-9]+-[0-9]+|\bsitting\b|\blent\b'
hits=$(git grep -n -I -E "$pattern" -- . ':(exclude).ci/check_words.sh' ':(exclude)tests/test_words_check.py')
status=$?
case $status in
    0)
        printf '%s\n' "$hits"
        echo "check_words: $(printf '%s\n' "$hits" | wc -l) line(s) above name a work session or how the work was organised; reword them" >&2
        exit 1
        ;;
    1)
        echo "check_words: no tracked file names a work session or how the work was organised"
        exit 0
        ;;
    *)
        echo "check_words: git grep failed (exit $status)" >&2
        exit 2
        ;;
esac
