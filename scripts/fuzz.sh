#!/usr/bin/env bash
# `make fuzz`: runs every libFuzzer target for a bounded time.
#   scripts/fuzz.sh BUILD_DIR FUZZ_DIR SECONDS
# BUILD_DIR is the normal build (its fuzz replay tests write the seeds: a real
# job's journal, a valid checkpoint image, a valid value for each parser);
# FUZZ_DIR the clang build with -DBALLAST_FUZZ=ON. Each target keeps its corpus
# in FUZZ_DIR/corpus/<target> (it grows from run to run) and writes what made
# it crash to FUZZ_DIR/crashes/<target>/. Exits non-zero when any target found
# a crash, naming the input to replay (`FUZZ_DIR/bin/<target> <file>`).
set -euo pipefail
BUILD_DIR=$1
FUZZ_DIR=$2
SECONDS_EACH=${3:-60}
TARGETS=(parser_fuzz master_journal_fuzz ckpt_reader_fuzz)

SEEDS="$FUZZ_DIR/seeds"
rm -rf "$SEEDS"
echo "fuzz: writing seeds from the replay tests"
BALLAST_FUZZ_SEEDS="$SEEDS" "$BUILD_DIR/bin/parser_fuzz_test" --gtest_filter='*FuzzEntryPoint*' >/dev/null 2>&1
BALLAST_FUZZ_SEEDS="$SEEDS" "$BUILD_DIR/bin/master_journal_fuzz_replay_test" >/dev/null 2>&1
BALLAST_FUZZ_SEEDS="$SEEDS" "$BUILD_DIR/bin/ckpt_reader_fuzz_replay_test" --gtest_filter='*ValidImageParses*' >/dev/null 2>&1

failed=()
for t in "${TARGETS[@]}"; do
  corpus="$FUZZ_DIR/corpus/$t"
  crashes="$FUZZ_DIR/crashes/$t"
  mkdir -p "$corpus" "$crashes"
  echo "fuzz: $t for ${SECONDS_EACH} s (corpus $corpus)"
  if ! "$FUZZ_DIR/bin/$t" -max_total_time="$SECONDS_EACH" -print_final_stats=1 -timeout=10 -rss_limit_mb=4096 \
      -artifact_prefix="$crashes/" "$corpus" "$SEEDS/$t" >"$FUZZ_DIR/$t.log" 2>&1; then
    echo "fuzz: $t FAILED; its log: $FUZZ_DIR/$t.log; the input: $(ls -t "$crashes" | head -1)" >&2
    tail -30 "$FUZZ_DIR/$t.log" >&2
    failed+=("$t")
    continue
  fi
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$FUZZ_DIR/$t.log" | tr '\n' ' ' | sed "s/^/fuzz: $t ok: /"
  echo
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: crashes in: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: ${#TARGETS[@]} targets, no crash"
