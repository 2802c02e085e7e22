#!/usr/bin/env bash
# Which CPU dispatch variables change the trained bits on this host (issue 15 groundwork).
# Trains the train stage (3 epochs, no DataLoader workers) once per setting in fresh
# processes and prints the first 16 hex digits of sha256_state_dict of the weights;
# equal digits mean bit-identical weights. The digits recipe (params.yaml), as pin_sets.sh. Run from the repository root after `make venv`:
#     bash benchmarks/cpu/cpu_pins.sh
set -euo pipefail
root=$(pwd)
export PATH="$root/.venv/bin:$PATH"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp params.yaml "$work/"
cd "$work"
mkdir raw
reprotrain prepare --raw-dir raw --out d.safetensors >/dev/null
reprotrain env --lock "$root/requirements-cpu.lock" --out env.json >/dev/null
run() {
	local name=$1
	shift
	mkdir -p "$name"
	env "$@" reprotrain train --data d.safetensors --env env.json --model "$name/m.safetensors" \
		--metrics "$name/met.json" --plots "$name/plots" --run-record "$name/run.json" \
		--checkpoints "$name/ck" -S train.max_epochs=3 -S data.init_args.num_workers=0 \
		-S data.init_args.path=d.safetensors >/dev/null
	printf '%-28s %s\n' "$name" "$(python -c "from reprotrain.hashing import sha256_state_dict as f, load_safetensors as l; print(f(l('$name/m.safetensors')[0])[:16])")"
}
grep -m1 "model name" /proc/cpuinfo
run baseline X=1
run baseline-again X=1
run ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=default
run ATEN_CPU_CAPABILITY=avx2 ATEN_CPU_CAPABILITY=avx2
run ONEDNN_MAX_CPU_ISA=SSE41 ONEDNN_MAX_CPU_ISA=SSE41
run ONEDNN_MAX_CPU_ISA=AVX ONEDNN_MAX_CPU_ISA=AVX
run ONEDNN_MAX_CPU_ISA=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
run MKL_CBWR=COMPATIBLE MKL_CBWR=COMPATIBLE
run MKL_CBWR=AVX2 MKL_CBWR=AVX2
run MKL_ENABLE_INSTRUCTIONS=AVX MKL_ENABLE_INSTRUCTIONS=AVX
run OMP_NUM_THREADS=1 OMP_NUM_THREADS=1
