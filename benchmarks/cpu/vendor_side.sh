#!/usr/bin/env bash
# One host's side of both recipes' training under the committed params (cpu.profile:
# portable), for diffing against a host of the other CPU vendor (issue 43, item 1):
# the step traces, op recordings of step 0, and the host and weights in host.json.
# Run from the repository root after `make venv`:
#     bash benchmarks/cpu/vendor_side.sh docs/cpu/<vendor>-<model>
# then, on the other vendor's host, at the commit named in that folder's host.json:
#     bash benchmarks/cpu/vendor_side.sh /tmp/here
#     .venv/bin/reprotrain compare /tmp/here/digits-trace.safetensors docs/cpu/<...>/digits-trace.safetensors
#     .venv/bin/reprotrain opdiff /tmp/here/digits-step0-ops.safetensors docs/cpu/<...>/digits-step0-ops.safetensors
# (and the same for lm-), or all of it in one command: bash benchmarks/cpu/vendor_check.sh.
# host.json also keeps benchmarks/cpu/kernel_bits.py's portable "all rows" digest.
# If the traces part after step 0, record that step instead:
# STEP=N bash benchmarks/cpu/vendor_side.sh ... records step N (files named stepN).
set -euo pipefail
out=${1:?usage: bash benchmarks/cpu/vendor_side.sh OUT_FOLDER}
step=${STEP:-0}
root=$(pwd)
export PATH="$root/.venv/bin:$PATH"
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

train() { # recipe, then the recipe's own arguments
	local recipe=$1
	shift
	REPROTRAIN_RECORD_OPS=$step REPROTRAIN_OPS_DIR="$work/$recipe-ops" reprotrain train "$@" \
		--model "$work/$recipe/model.safetensors" --trace "$out/$recipe-trace.safetensors" \
		--metrics "$work/$recipe/metrics.json" --plots "$work/$recipe/plots" \
		--run-record "$work/$recipe/run.json" --checkpoints "$work/$recipe/ckpt" >/dev/null
	cp "$work/$recipe-ops/ops-rank0.safetensors" "$out/$recipe-step$step-ops.safetensors"
}

mkdir -p "$work/raw"
reprotrain env --raw-dir "$work/raw" --out "$work/digits-env.json" >/dev/null
reprotrain prepare --raw-dir "$work/raw" --out "$work/digits.safetensors" >/dev/null
train digits --env "$work/digits-env.json" --data "$work/digits.safetensors" \
	-S "data.init_args.path=$work/digits.safetensors"
reprotrain env --params pipelines/lm/params.yaml --out "$work/lm-env.json" >/dev/null
train lm --params pipelines/lm/params.yaml --env "$work/lm-env.json"

python - "$out" "$work" <<'EOF'
import json, subprocess, sys
from pathlib import Path

from reprotrain.hashing import load_safetensors, sha256_state_dict

out, work = Path(sys.argv[1]), Path(sys.argv[2])
cpu = {}
for line in Path("/proc/cpuinfo").read_text().splitlines():
    key, _, value = line.partition(":")
    if key.strip() in ("vendor_id", "cpu family", "model", "model name", "cache size"):
        cpu.setdefault(key.strip(), value.strip())
flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
cpu["avx512f"] = " avx512f" in flags
git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
commit = git("rev-parse", "HEAD") + (" (with changes)" if git("status", "--porcelain", "src") else "")
weights = {
    recipe: sha256_state_dict(load_safetensors(work / recipe / "model.safetensors")[0])
    for recipe in ("digits", "lm")
}
bits = subprocess.run(
    [sys.executable, "benchmarks/cpu/kernel_bits.py"], capture_output=True, text=True, check=True
).stdout
kernels = next(l.split()[-1] for l in bits.splitlines() if l.startswith("portable") and "all rows" in l)
record = {
    "commit": commit,
    "cpu": cpu,
    "kernel_bits_all_rows": kernels,
    "weights_sha256_state_dict": weights,
}
(out / "host.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
print(json.dumps(record, indent=2, sort_keys=True))
EOF
