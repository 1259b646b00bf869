#!/usr/bin/env bash
# The long seed swarm of every fault scenario: thousands of seeds each, on
# every core, every failing seed listed with the first invariant it broke.
# CI runs 128 seeds of each (crates/sim/tests/swarms.rs); run this before a
# change to the cluster protocol lands, and keep any seed it finds as a
# regression test there.
#
#   tests/sim/swarm.sh            # 2000 seeds of each fault scenario
#   SEEDS=10000 FIRST=5000 tests/sim/swarm.sh chaos-storm pd-chaos-storm
set -euo pipefail
cd "$(dirname "$0")/../.."
SEEDS=${SEEDS:-2000}
FIRST=${FIRST:-1}
scenarios=("$@")
if [ ${#scenarios[@]} -eq 0 ]; then
  scenarios=(fault-storm pd-fault-storm chaos-storm pd-chaos-storm rolling-drain pd-rolling-drain pd-kill-cancel kv-offload-faults pd-kill-cancel-small-kv)
fi
cargo build --release -p flotilla --quiet
status=0
for s in "${scenarios[@]}"; do
  ./target/release/flotilla simulate "simulations/${s%.toml}.toml" \
    --seed "$FIRST" --seeds "$SEEDS" || status=1
done
exit $status
