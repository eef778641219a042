# Sourced by the scripts that run bench/core.sh several times in one device call (ab_1b.sh, liger_chunk.sh):
# `one TAG` runs core.sh into $O/TAG within what is left of $BUDGET (VARIANTS, BASELINES, EXTRA, STEPS, EVERY,
# SRC, BEXTRA from the environment); `finish TITLE...` writes $O/table.md (the title lines, then every run's rows
# with ratios against the call's baselines: bench/combine.py), $O/results.jsonl and $O/raw.tgz, and prints the table.
# Needs O, BUDGET and START set by the caller.
TAGS=""
left() { echo $((BUDGET - (SECONDS - START))); }
one() {
  local tag=$1 b
  b=$(left)
  [ "$b" -lt 60 ] && { echo "== $tag skipped: ${b}s left"; return; }
  OUT=$O/$tag BUDGET=$b bash bench/core.sh > "$O/$tag.log" 2>&1
  export SKIP_INSTALL=1  # installed once, by the first run, into /tmp/site
  [ -d /tmp/site ] && case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH};; esac
  TAGS="$TAGS $tag"
}
finish() {
  {
    printf '%s\n' "$@"
    echo
    # shellcheck disable=SC2086
    python3 bench/combine.py "$O" $TAGS --results "$O/results.jsonl"
  } > "$O/table.md"
  tar czf "$O/raw.tgz" -C "$O" --exclude=raw.tgz --exclude=table.md --exclude=results.jsonl . 2>/dev/null
  find "$O" -mindepth 1 -maxdepth 1 ! -name table.md ! -name raw.tgz ! -name results.jsonl -exec rm -rf {} +
  cat "$O/table.md"
}
