#!/usr/bin/env bash
# Runs a pytest command line (the arguments); when its only failures were crashed test
# processes, runs the tests they left once more (tests/crash_resume.py). Its exit status is
# that of the last run.
set -u
ledger=$(mktemp -d "${TMPDIR:-/tmp}/olmo_jax_test_ledger.XXXXXX")
trap 'rm -rf "$ledger"' EXIT
OLMO_JAX_TEST_LEDGER="$ledger" "$@"
rc=$?
if [ "$rc" != 0 ] && [ -s "$ledger/resume" ]; then
  echo "pytest_resume: a test process crashed (its stack is in the failure report above);" \
       "running the tests that had not ended, once more" >&2
  OLMO_JAX_TEST_RESUME="$ledger/resume" "$@"
  rc=$?
fi
exit "$rc"
